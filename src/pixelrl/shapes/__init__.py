"""The embedded shapes world: scene grammar and renderer (`world`), the text task (`text`), the
question-answer task (`qa`), the editing task (`edit_world`, judged by `edit_evaluate`), the
detector reward (`detector`), GenEval-style evaluation (`evaluate`), pretraining of the shipped
models (`pretrain`, `pretrain_edit`, `qa_model`), preference making (`preferences`), the
gradient-noise tool and the demos (`demo`, `distill_demo`, `edit_demo`).

Nothing below this folder imports it: importing the package registers the `shapes_geneval` and
`shapes_edit` rewards and the `shapes_qa` question task in the lower registries, as a user's plugin would
(declared in `pixelrl/__init__.py`)."""

from pixelrl.shapes import detector, edit_world, qa  # noqa: F401  (register the rewards and the QA task)
