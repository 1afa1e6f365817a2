"""Parallelism in one place: the process group and each rank's place in the data x sequence mesh
(`group.py`), how a model is replicated or sharded over the data dimension (`fsdp.py`), and full
copies of sharded weights and optimizer state (`state.py`)."""
