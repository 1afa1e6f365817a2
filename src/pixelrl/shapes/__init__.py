"""The embedded default world's recipes: pretraining the shipped shapes model (an SD3-family
pipeline folder, `builtin:shapes`). Nothing below this folder imports it."""
