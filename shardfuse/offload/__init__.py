"""Layer-wise CPU offload: ``OffloadModel`` and ``checkpoint_wrapper`` (see DESIGN.md, "Offload")."""

from shardfuse.offload._checkpoint import checkpoint_wrapper, disable_checkpointing
from shardfuse.offload._model import OffloadModel

__all__ = ["OffloadModel", "checkpoint_wrapper", "disable_checkpointing"]
