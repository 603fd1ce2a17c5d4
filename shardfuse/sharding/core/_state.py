"""The training-state machine of a sharded unit: which phase it is in, and clear errors for misuse."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class TrainingState(enum.Enum):
    """Phase of one ``FullyShardedDataParallel`` unit (FairScale's states).

    - ``IDLE``: between iterations; the module's parameters are the sharded flat parameters.
    - ``FORWARD``: inside the unit's ``forward``.
    - ``BACKWARD_PRE``: the pre-backward hook ran (full parameters gathered for backward).
    - ``BACKWARD_POST``: the post-backward hook ran (gradient reduce-scattered, parameters resharded).
    - ``SUMMON_FULL_PARAMS``: inside ``summon_full_params()``.
    """

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


# What each action needs the unit to be doing, and what to tell the user when it is not.
_HINTS: dict[TrainingState, str] = {
    TrainingState.FORWARD: "it is running its forward pass",
    TrainingState.BACKWARD_PRE: "its backward pass is running",
    TrainingState.BACKWARD_POST: "its backward pass is running",
    TrainingState.SUMMON_FULL_PARAMS: "it is inside summon_full_params()",
    TrainingState.IDLE: "it is idle",
}


def check_state(
    current: TrainingState, allowed: Iterable[TrainingState], action: str, unit: str, fix: str = ""
) -> None:
    """Raise ``RuntimeError`` when ``current`` is not one of ``allowed``.

    Args:
        current: the unit's state now.
        allowed: the states in which ``action`` is legal.
        action: what the caller tried, e.g. ``"state_dict()"``.
        unit: a short name of the unit for the message.
        fix: how to fix it, appended to the message.
    """
    allowed = tuple(allowed)
    if current in allowed:
        return
    names = ", ".join(s.name for s in allowed)
    msg = (
        f"{action} is not allowed on {unit} while {_HINTS[current]} (state={current.name}); "
        f"it needs state in [{names}]"
    )
    raise RuntimeError(f"{msg}: {fix}" if fix else msg)
