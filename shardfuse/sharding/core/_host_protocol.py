"""What the flat-shard core calls in the host tier: the host side of an offloaded shard (``HostSide``,
``FlatParamHandle.host``) and where a unit's saved activations go (``SavedActivations``, ``Unit.saved_activations``).

The core (gathers in ``_flat_param``, gradient reduction in ``_grad_reduce``, the no_sync decision in
``_runtime``) knows the host tier only through ``HostSide``; ``_host_shard.HostShard`` (and the SSD tier's
subclass) implement it. ``send_grad`` is called from autograd's device thread (the post-backward hook), the others
from the main thread; every method may block on the shard's update in flight on the host worker. The unit's forward
and pre-backward hook reach ``_activations.ActivationOffload`` through ``SavedActivations``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch


class HostSide(Protocol):
    """The host side of one offloaded flat parameter, as the core sees it."""

    # Under no_sync, keep the gathered compute-dtype parameters on the GPU between micro-steps.
    keep_full_in_no_sync: bool
    # step_in_backward: called with (this shard, the copy's event) once its gradient copy is queued.
    on_grad_sent: Callable[[Any, torch.cuda.Event | None], None] | None
    # Keep the gathered compute-dtype parameters on the GPU from the unit's forward to its backward.
    keep_for_backward: bool
    # Take the compute-dtype gradient (send_grad's ``lowp``) where the reduction is exact in that dtype.
    lowp_grads: bool

    def wait_ready(self) -> None:
        """Block until no update of this shard is in flight; raise what a failed update raised."""

    def source_for_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """What crosses to the device when the unit is gathered (after the update in flight)."""
        ...

    def note_h2d(self, stream: torch.cuda.Stream | None) -> None:
        """The host->device copy that reads the source was just queued on ``stream``."""

    def send_grad(self, flat: torch.Tensor, dest: torch.Tensor, stream: torch.cuda.Stream | None,
                  lowp: torch.Tensor | None = None) -> None:
        """Queue the copy of the reduced gradient ``dest`` to the host on ``stream`` (autograd's device thread);
        ``lowp``: the same values in the compute dtype (``dest`` is their exact fp32 cast), which may cross
        instead."""

    def settle_grad(self) -> None:
        """Before the gradient is read or scaled outside an update (``torch.nn.utils.clip_grad_norm_``): apply
        what the engine deferred to the update (the last clip's coefficient)."""

    def land_grad(self, flat: torch.Tensor) -> None:
        """After the copies finished (end of backward): ``flat.grad`` holds the gradient."""


class SavedActivations(Protocol):
    """Where a unit's forward keeps what autograd saves for backward, as the core sees it (``Unit.saved_activations``;
    the host tier's ``ActivationOffload`` implements it)."""

    def forward_context(self, unit: Any) -> contextlib.AbstractContextManager[None]:
        """Entered around the wrapped module's forward (not around an activation-checkpoint recompute)."""
        ...

    def before_backward(self, unit: Any) -> None:
        """``unit``'s pre-backward hook ran (autograd's device thread): its backward starts."""
