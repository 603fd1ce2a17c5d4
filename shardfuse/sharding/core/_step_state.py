"""Per-step state of one flat parameter, apart from its fixed layout (``_flat_param.py``).

Written during a step by the gather (``FlatParamHandle.unshard``/``reshard``), the runtime (``_runtime.py``)
and the gradient path (``_grad_reduce.py``); :meth:`HandleStep.reset` is the one way it returns to "no step
in flight": at the end of backward, when the full buffer is made again at lazy init, and when pickling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class HandleStep:
    """What one flat parameter did in the current step."""

    is_full: bool = False
    """The full buffer holds gathered values (its storage is allocated)."""
    gathered_version: int = -1
    """The shard's version counter at that gather: a changed shard (an optimizer step) is gathered again."""
    forward_version: int | None = None
    """The shard's version when forward last used it: backward must see the same parameters."""
    float8: bool = False
    """The gathered buffer is the float8 bytes of a float8 flat parameter (``_fp8_gather.py``), not the
    compute-dtype full buffer."""
    ag_event: Any = None
    """The event of a pending all-gather the compute stream has not waited for yet (None on the CPU)."""
    fired: bool = False
    """The post-backward hook ran in this backward pass."""
    grad_reduced: bool = False
    """A reduction wrote ``flat.grad`` in this backward: only then do the original-parameter views' gradients
    follow it (after a ``no_sync`` backward ``flat.grad`` may be a stale one the user zeroed on the views)."""
    fused: Any = None
    """The views' gradients kept apart by the unflatten node (``_fused_grads.Stash``) until the grad token's hook
    reduces them."""

    def reset(self, keep_full: bool = False) -> None:
        """No step in flight: the full buffer freed, nothing pending, no hook fired. ``keep_full``: the gathered
        buffer stays (``OffloadOptimizer(accumulate_on_gpu=True)`` between ``no_sync`` micro-steps)."""
        # Runs for every flat parameter at the end of every backward: one dict update from the defaults read
        # once from the fields (below the class), not a dataclasses.fields() walk and a setattr per field.
        if keep_full:
            kept = (self.is_full, self.float8, self.gathered_version, self.ag_event)
            self.__dict__.update(_DEFAULTS)
            self.is_full, self.float8, self.gathered_version, self.ag_event = kept
        else:
            self.__dict__.update(_DEFAULTS)

    def freed(self) -> None:
        """The full buffer was freed (resharded) in the middle of a step."""
        self.is_full = False
        self.ag_event = None


# Every field's default (all plain values, no default factories), read once from the dataclass.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(HandleStep)}
