"""The wrapper's checkpoint methods: full, local and sharded state dicts and the optimizer state's consolidation.

``FullyShardedDataParallel`` inherits them from :class:`CheckpointAPI`; each is a collective entry point that
finishes host optimizer steps in flight, settles lazy init and hands over to the checkpoint layer
(``checkpoint/_state_dict.py``, ``_optim_state.py``, ``_dcp.py``), which does the work. Apart from the wrapper's
training-step face (forward, ``no_sync``, clipping, summoning) because users reach them at other times: to save,
to resume, to consolidate offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfuse._profiling import profiled
from shardfuse.sharding.checkpoint import _dcp, _optim_state, _state_dict
from shardfuse.sharding.checkpoint._dcp_guard import torch_dsd_fqn_modifiers
from shardfuse.sharding.core._arrival import collective_call
from shardfuse.sharding.core._hybrid import refuse
from shardfuse.sharding.core._root import lazy_init
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.host._engine import finish_host_steps, settle

_DSD_INSTEAD = ("its get_state_dict/set_state_dict cannot present the replicated shards; use dcp.save/dcp.load with "
               "model.sharded_state_dict(optim) and model.load_sharded_state_dict(state, optim) instead")


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class CheckpointAPI(nn.Module):
    """The checkpoint half of ``FullyShardedDataParallel``'s public methods (see the module docstring)."""

    @property
    def _unit(self) -> Unit:  # the wrapper's unit (``FullyShardedDataParallel._unit``)
        raise NotImplementedError("CheckpointAPI is FullyShardedDataParallel's base: use that class")

    # FairScale's legacy positional form too: one signature cannot match nn.Module's two overloads.
    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> dict[str, Any]:
        """Full state dict under the original parameter names (no wrapper prefixes), gathered in fp32.

        With ``state_dict_on_rank_0_only`` only rank 0 gets the tensors (others ``{}``); every rank must call.
        """
        finish_host_steps(self._unit)  # an OffloadOptimizer step in flight writes the shards
        if args:  # legacy positional form state_dict(destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        with collective_call(self._unit, "state_dict"):
            lazy_init(self._unit)
            sd = _state_dict.full_state_dict(self)
            if destination is None:
                destination = type(sd)()
            for k, v in sd.items():
                destination[prefix + k] = v
            return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> NamedTuple:
        """Load a full state dict (original names, e.g. from an unwrapped model); every rank must call."""
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) is not supported: parameters are flat shards")
        with collective_call(self._unit, "load_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            missing, unexpected = _state_dict.load_full_state_dict(self, state_dict, strict)
            return _IncompatibleKeys(missing, unexpected)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's flat shards and the buffers, as FairScale names them: ``<unit path>.flat_param_<i>``
        and the buffers' own names, with no wrapper segment (see :meth:`local_metadata_dict`)."""
        with profiled("shardfuse.sharding:local_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            return _state_dict.local_state_dict(self)

    def local_metadata_dict(self) -> dict[str, Any]:
        """What :meth:`consolidate_shard_weights` needs to rebuild full weights from every rank's
        :meth:`local_state_dict` offline (FairScale's format: per unit, each flat parameter's original names,
        shapes, numels and this rank's padding; the buffer names)."""
        lazy_init(self._unit)
        return _state_dict.local_metadata_dict(self)

    # Full weights (original names) from every rank's local_state_dict() and local_metadata_dict(), in rank
    # order, offline (no process group); buffers come from rank 0. FairScale's static method.
    consolidate_shard_weights = staticmethod(_state_dict.consolidate_shard_weights)

    def load_local_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> NamedTuple:
        """Load a dict from :meth:`local_state_dict` saved with the same world size and wrapping."""
        with profiled("shardfuse.sharding:load_local_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            missing, unexpected = _state_dict.load_local_state_dict(self, state_dict, strict)
            return _IncompatibleKeys(missing, unexpected)

    def gather_full_optim_state_dict(
        self, optim: torch.optim.Optimizer, recipient_rank: int | None = 0, **ignored: Any
    ) -> dict[str, Any] | None:
        """Consolidate the optimizer state of the sharded flat parameters into per-original-parameter state.

        Every rank must call; the result lands on ``recipient_rank`` (all ranks with ``None``), other ranks
        get ``None`` (hybrid sharding: ``recipient_rank`` is a rank of the shard group, of replica 0 only); a
        rank outside the group is a ``ValueError``. Per-element state (``exp_avg``, ``momentum_buffer``...) is
        gathered and unflattened (0-dim parameters keep 0-dim state); scalars (``step``) are copied per
        parameter. Tensors come back on the CPU, numbered like the unwrapped model's ``parameters()`` (module
        order), so the dict also loads into a plain optimizer of the unwrapped model; several param groups are
        kept.
        """
        if ignored:
            raise TypeError(f"gather_full_optim_state_dict got unsupported arguments {sorted(ignored)}")
        with collective_call(self._unit, "gather_full_optim_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            full = _optim_state.gather_full_optim_state_dict(self, optim, recipient_rank)
            # Hybrid sharding: each replica gathered the same dict over its shard group; replica 0's recipient has it.
            return full if recipient_rank is None or self._unit.groups.replicate_rank == 0 else None

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's optimizer state dict (for ``optim.load_state_dict``, also of a fresh optimizer that has
        not stepped yet) from a consolidated one, at any world size. As in FairScale, tensors are on the CPU
        (``load_state_dict`` moves them to the parameters' device) and the input dict is consumed."""
        with profiled("shardfuse.sharding:get_shard_from_optim_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            return _optim_state.get_shard_from_optim_state_dict(self, full_optim_state_dict)

    def sharded_state_dict(self, optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint of the model (and ``optim``, when given), for
        ``torch.distributed.checkpoint.save``, and the dict to fill with ``torch.distributed.checkpoint.load``
        before :meth:`load_sharded_state_dict`; it reshards to any world size with the same wrapping.

        Each flat parameter, and each per-element optimizer state of it, is a ``DTensor`` of its whole flat range
        (``Shard(0)``) whose local tensor is a view of this rank's piece (no copy); buffers are plain tensors. A
        fresh optimizer's state is laid out without stepping it. Root only; every rank must call.
        """
        with collective_call(self._unit, "sharded_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            return _dcp.sharded_state_dict(self, optim)

    def load_sharded_state_dict(self, state_dict: dict[str, Any], optim: torch.optim.Optimizer | None = None, *,
                                trust_checkpoint: bool = False) -> None:
        """Load a dict made by :meth:`sharded_state_dict` (with the same ``optim`` argument) on this model and
        filled by ``torch.distributed.checkpoint.load``: the shards, buffers and (with ``optim``) the optimizer
        state and hyper-parameters, also into a fresh optimizer. A checkpoint of another wrapping, a dict that was
        not filled, or optimizer groups that differ from the saved ones raise before anything is written. Packed
        values load as plain data (no code runs); an object only full pickle rebuilds raises UnsafeCheckpointError
        unless ``trust_checkpoint=True``, which runs any code it carries. Root only; every rank must call."""
        with collective_call(self._unit, "load_sharded_state_dict"):
            settle(self._unit)  # finishes host optimizer steps in flight, then lazy init
            _dcp.load_sharded_state_dict(self, state_dict, optim, trust_checkpoint)

    def _fqn_modifiers(self) -> dict[str, str]:
        """Asked by ``torch.distributed.checkpoint.state_dict`` (only): the wrapped module's modifiers, after
        refusing the paths that would checkpoint the optimizer's shards wrongly (see ``_dcp.py``)."""
        refuse(self._unit.groups, "torch.distributed.checkpoint.state_dict", _DSD_INSTEAD)
        return torch_dsd_fqn_modifiers(self)
