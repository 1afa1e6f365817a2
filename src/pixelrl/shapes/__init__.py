"""The embedded shapes world: scene grammar and renderer (`world`), the text task (`text`), the
question-answer task (`qa`), the detector reward (`detector`), GenEval-style evaluation
(`evaluate`), pretraining of the shipped models (`pretrain`, `qa_model`), preference making
(`preferences`), the gradient-noise tool and the demo.

Nothing below this folder imports it: importing the package registers the `shapes_geneval`
reward and the `shapes_qa` question task in the lower registries, as a user's plugin would
(declared in `pixelrl/__init__.py`)."""

from pixelrl.shapes import detector, qa  # noqa: F401  (register the reward and the QA task)
