"""Float8 training with torchao on shardfuse-wrapped models (docs/recipes.md, "Train with float8 matmuls").

Nothing here is imported by ``import shardfuse``: torchao is an optional dependency, imported on first use.
"""

from shardfuse.float8._convert import convert_to_float8_training, float8_compatible

__all__ = ["convert_to_float8_training", "float8_compatible"]
