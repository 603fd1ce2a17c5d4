"""Consolidate the optimizer state of sharded flat parameters into per-original-parameter state, and back.

The consolidated ("full") optimizer state dict looks like ``optimizer.state_dict()`` of the unwrapped model
with extra keys, in FairScale 0.4.13's layout where our flat layout allows:

- ``state``: ``{global id: {key: value}}``, one entry per original parameter whose flat parameter has
  optimizer state (parameters that never got a gradient have none, as in ``torch.optim``). Global ids number
  the original parameters in module order, i.e. the order of ``unwrapped_model.parameters()`` (shared
  parameters once, under their first name). Tensors are on the CPU.
- ``param_groups``: the optimizer's groups, hyper-parameters unchanged, ``params`` listing the global ids of
  the original parameters behind the group's flat parameters, ascending (a ``param_names`` entry, if the
  optimizer keeps one, lists their original names).
- ``param_names``: the original name of every global id.
- ``param_id_map``: global id -> the optimizer's index of the flat parameter holding it (``None`` when that
  flat parameter is not in the optimizer).
- ``uncollected_local_ids``: optimizer indices of the flat parameters of ``no_broadcast_optim_state`` units
  (size-1 groups, e.g. mixture-of-experts experts): their state is the recipient rank's own, not gathered.
- ``"shardfuse"``: what resharding needs that the rest does not say (which state keys are per-element).
- any other top-level key of ``optimizer.state_dict()`` (e.g. a ``loss_scale``), copied.

Per-element state is recognised per flat parameter: a state tensor shaped like the shard (1-D,
``shard_numel`` elements: ``exp_avg``, ``momentum_buffer``...) is all-gathered, its padding dropped, and cut
into the original parameters' shapes (a 0-dim parameter gets 0-dim state). Anything else (``step``, scalars,
non-tensors) is copied to each original parameter of the flat parameter.

So the dict loads directly into a ``torch.optim`` optimizer of the *unwrapped* model whose groups hold the
original parameters behind each group's flat parameters, in module order (one group: ``model.parameters()``),
and :func:`get_shard_from_optim_state_dict` turns it back into a state dict for the sharded optimizer, at any
world size, for the same wrapping (the same parameters in the same units), also into a fresh optimizer that
has not stepped yet (no dummy step needed).

Devices and memory, as in FairScale: gathering runs one all-gather per flat parameter and per-element key into
a buffer on the compute device that is freed before the next, plus one tiny all-reduce that checks every rank
holds the same state (an error on every rank instead of mismatched collectives); the result holds CPU tensors
only and no device memory stays allocated. Resharding returns the shards on the device of the full dict's
tensors (the CPU) and ``optim.load_state_dict`` moves them to the parameters' device. Resharding consumes its
input (modifies it in place and returns it), as FairScale's does.

Differences from FairScale 0.4.13 (documented, by design):

- several parameter groups are supported (FairScale asserts one);
- ``step`` keeps the type the optimizer uses (a 0-dim tensor in torch 2.x). FairScale turns it into a Python
  number, writing that into the live optimizer state as a side effect; shardfuse never modifies the optimizer;
- other 0-dim and non-per-element state is the recipient rank's (FairScale gathers 0-dim tensors of every rank
  into a list and hands rank ``r`` its own entry when resharding);
- ``param_id_map`` maps to the flat parameter's optimizer index even when it has no state (FairScale: ``None``);
  ``None`` means the flat parameter is not in the optimizer at all;
- optimizer state shaped in other ways than the flat shard (e.g. factored second moments) is not per-element
  here and is copied per parameter, which is only right if it does not depend on the shard.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardfuse.sharding.core import _collectives as coll
from shardfuse.sharding.core._flat_param import SHARD_MARK_KEY, FlatParamHandle
from shardfuse.sharding.core._runtime import Unit
from shardfuse.sharding.core._tree import check_idle, param_names, require_unit, units_below

_META_KEY = "shardfuse"
_FORMAT = 2
_LAYOUT_KEYS = ("state", "param_groups", "param_names", "param_id_map", "uncollected_local_ids", _META_KEY)
_CPU = torch.device("cpu")


@dataclass
class _Flat:
    """One flat parameter of the tree and the global ids (module order) of its originals, in flat order."""

    unit: Unit
    handle: FlatParamHandle
    gids: list[int]

    @property
    def collected(self) -> bool:
        """False where the local state is already the full state (size-1 group): nothing to gather."""
        return self.unit.world_size > 1 and not self.unit.no_broadcast_optim_state


def _layout(root: nn.Module) -> tuple[list[_Flat], list[str]]:
    """Every flat parameter of the tree (units in module order) and the original names by global id."""
    names = param_names(root)  # insertion order = state-dict order = the unwrapped model's parameters() order
    gid = {key: i for i, key in enumerate(names)}
    flats = [
        _Flat(u, h, [gid[(id(u), hi, i)] for i in range(len(h.shapes))])
        for u in units_below(require_unit(root))
        for hi, h in enumerate(u.handles)
    ]
    return flats, list(names.values())


def _refuse_orig_params(units: list[Unit], action: str) -> None:
    # The optimizer of a use_orig_params model holds per-parameter views, which this flat layout does not read.
    if any(u.config.use_orig_params for u in units):
        raise NotImplementedError(
            f"{action} consolidates optimizers over the flat shards; with use_orig_params=True (or "
            f"flatten_parameters=False) the optimizer holds per-parameter views: checkpoint it with the sharded "
            f"state dict (torch.distributed.checkpoint) instead"
        )


def _optim_index(optim: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its index in ``optim.state_dict()`` (numbered through the groups in order)."""
    out: dict[int, int] = {}
    for g in optim.param_groups:
        for p in g["params"]:
            out.setdefault(id(p), len(out))
    return out


def _is_per_element(v: Any, h: FlatParamHandle) -> bool:
    """State shaped like the flat shard (per-element), as opposed to scalars such as ``step``."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == h.shard_numel and h.shard_numel > 0


def _to_cpu(v: Any) -> Any:
    """A CPU copy that shares nothing with ``v`` (tensors, or anything deep-copyable)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(_CPU, copy=True)
    return copy.deepcopy(v)


def _check_recipient(recipient_rank: Any, world_size: int) -> int | None:
    if recipient_rank is None:
        return None
    try:
        if isinstance(recipient_rank, bool):
            raise TypeError
        r = operator.index(recipient_rank)
    except TypeError:
        r = -1
    if not 0 <= r < world_size:
        raise ValueError(
            f"gather_full_optim_state_dict(recipient_rank={recipient_rank!r}): not a rank of the root's process "
            f"group (world_size={world_size}): pass a rank in [0, {world_size - 1}], or None to return the full "
            f"state on every rank"
        )
    return r


def _check_same_state_on_all_ranks(root_unit: Unit, flats: list[_Flat], per_elem: dict[int, list[str]],
                                   index: dict[int, int], names: list[str]) -> None:
    """One small all-reduce: every rank must hold the same per-element state, or the gathers would not match
    up (a hang or garbage) — raise the same error on every rank instead."""
    if root_unit.world_size == 1:
        return
    counts = [len(per_elem.get(index[id(f.handle.flat)], ())) if f.collected else 0 for f in flats
              if id(f.handle.flat) in index]
    if not counts:
        return
    t = torch.tensor(counts + [-c for c in counts], dtype=torch.int64, device=root_unit.compute_device)
    coll.all_reduce_(t, root_unit.groups.process_group, root_unit.world_size, op="max")
    hi, lo = t[: len(counts)].tolist(), [-x for x in t[len(counts):].tolist()]
    bad = [i for i, (a, b) in enumerate(zip(hi, lo)) if a != b]
    if bad:
        in_optim = [f for f in flats if id(f.handle.flat) in index]
        where = [f"{names[in_optim[i].gids[0]]}... ({lo[i]} to {hi[i]} state tensors)" for i in bad[:4]]
        raise RuntimeError(
            f"gather_full_optim_state_dict(): the ranks hold different optimizer state for the flat parameters "
            f"starting at {where} (this rank: {[counts[i] for i in bad[:4]]}): every rank must step the same "
            f"parameters (same requires_grad, same parameters used in backward) before consolidating"
        )


def _gather_setup(root: nn.Module, optim: torch.optim.Optimizer, recipient_rank: int | None
                  ) -> tuple[Unit, int | None, list[_Flat], list[str], dict[int, int]]:
    """The root unit, the recipient, the layout and the optimizer's indices, after checking the arguments."""
    unit = require_unit(root)
    check_idle(units_below(unit), "gather_full_optim_state_dict()")
    if not unit.is_root:
        raise RuntimeError(
            f"gather_full_optim_state_dict() must be called on the root FullyShardedDataParallel, not on the nested "
            f"{unit.name}: call it on the outermost wrapper"
        )
    _refuse_orig_params(units_below(unit), "gather_full_optim_state_dict()")
    recipient = _check_recipient(recipient_rank, unit.world_size)
    flats, names = _layout(root)
    index = _optim_index(optim)
    ours = {id(f.handle.flat) for f in flats}
    foreign = [i for pid, i in index.items() if pid not in ours]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameters that are not flat parameters of this "
            f"FullyShardedDataParallel tree (indices {foreign[:8]}): build the optimizer on the root's parameters()"
        )
    return unit, recipient, flats, names, index


def _per_element_keys(flats: list[_Flat], index: dict[int, int], osd: dict[str, Any]) -> dict[int, list[str]]:
    """Optimizer index -> the keys of its per-element state, for the flat parameters that have any."""
    per_elem: dict[int, list[str]] = {}
    for f in flats:
        li = index.get(id(f.handle.flat))
        if li is None:
            continue
        st = osd["state"].get(li)
        if st:
            keys = [k for k, v in st.items() if _is_per_element(v, f.handle)]
            if keys:
                per_elem[li] = keys
    return per_elem


def _gather_state(flats: list[_Flat], index: dict[int, int], osd: dict[str, Any], per_elem: dict[int, list[str]],
                  receive: bool) -> dict[int, dict[str, Any]]:
    """Each original parameter's state (global id -> key -> value, CPU tensors) on the receiving ranks; the
    other ranks take part in the all-gathers and get an empty dict."""
    state: dict[int, dict[str, Any]] = {}
    for f in flats:
        h = f.handle
        li = index.get(id(h.flat))
        st = osd["state"].get(li) if li is not None else None
        if st is None:
            continue
        gathered: dict[Any, list[torch.Tensor]] = {}
        # The same order on every rank (the collectives must pair up), whatever the dicts' insertion order.
        for key in sorted(per_elem.get(li, ()), key=str) if li is not None else ():
            v = st[key].detach()
            if f.collected:
                full = h.gather_full_precision(f.unit.compute_device, source=v)
            else:
                full = v  # a size-1 group: the shard is the full (unpadded) flat state
            if receive:
                gathered[key] = [t.to(_CPU, copy=True) for t in h.split_full(full)]
            del full
        if not receive:
            continue
        for j, g in enumerate(f.gids):
            # The shard mark names this rank's shard: the consolidated state is of the whole parameter.
            state[g] = {k: (gathered[k][j] if k in gathered else _to_cpu(v)) for k, v in st.items()
                        if k != SHARD_MARK_KEY}
    return state


def _full_groups(osd: dict[str, Any], flats: list[_Flat], index: dict[int, int], names: list[str]
                 ) -> tuple[list[dict[str, Any]], dict[int, int | None]]:
    """The param groups in global ids (``params``, ``param_names``), and ``param_id_map``."""
    li_to_gids = {index[id(f.handle.flat)]: sorted(f.gids) for f in flats if id(f.handle.flat) in index}
    param_id_map: dict[int, int | None] = {g: None for g in range(len(names))}
    for li, gids in li_to_gids.items():
        for g in gids:
            param_id_map[g] = li
    groups = []
    for pg in osd["param_groups"]:
        gids = sorted(g for li in pg["params"] for g in li_to_gids[li])
        new: dict[str, Any] = {}
        for k, v in pg.items():
            if k == "params":
                new[k] = gids
            elif k == "param_names":
                new[k] = [names[g] for g in gids]
            else:
                new[k] = copy.deepcopy(v)
        groups.append(new)
    return groups, param_id_map


@torch.no_grad()
def gather_full_optim_state_dict(
    root: nn.Module, optim: torch.optim.Optimizer, recipient_rank: int | None
) -> dict[str, Any] | None:
    """See ``FullyShardedDataParallel.gather_full_optim_state_dict`` and the module docstring.

    Every rank of the root's process group must call. Per flat parameter and per-element state key, one
    all-gather into a buffer on the compute device, freed before the next; the result holds CPU tensors only,
    so no device memory stays allocated. ``recipient_rank=None`` returns the dict on every rank.
    """
    unit, recipient, flats, names, index = _gather_setup(root, optim, recipient_rank)
    osd = optim.state_dict()  # references the live state: read only
    receive = recipient is None or unit.rank == recipient
    per_elem = _per_element_keys(flats, index, osd)
    _check_same_state_on_all_ranks(unit, flats, per_elem, index, names)
    state = _gather_state(flats, index, osd, per_elem, receive)
    if not receive:
        return None
    groups, param_id_map = _full_groups(osd, flats, index, names)
    out: dict[str, Any] = {
        "state": dict(sorted(state.items())),
        "param_groups": groups,
        "param_names": names,
        "param_id_map": param_id_map,
        "uncollected_local_ids": sorted(
            index[id(f.handle.flat)] for f in flats
            if f.unit.no_broadcast_optim_state and index.get(id(f.handle.flat)) in osd["state"]
        ),
    }
    out.update((k, _to_cpu(v)) for k, v in osd.items() if k not in ("state", "param_groups") and k not in out)
    out[_META_KEY] = {"format": _FORMAT, "world_size": unit.world_size, "per_element": per_elem}
    return out


def _check_per_element(vals: list[Any], h: FlatParamHandle, key: str, names: list[str]) -> None:
    for v, n, name in zip(vals, h.numels, names):
        if not isinstance(v, torch.Tensor) or v.numel() != n:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"optimizer state {key!r} of {name} is per-element but has shape {got}, not the parameter's "
                f"{n} elements: load a state dict consolidated from this model"
            )


def _shard_slice(vals: list[torch.Tensor], h: FlatParamHandle) -> torch.Tensor:
    """This rank's padded shard of the flat concatenation of ``vals`` (one per original parameter), built from
    the overlapping pieces only (no full-size buffer), on the device of ``vals``; padding is zero."""
    first = vals[0]
    out = torch.zeros(h.shard_numel, dtype=first.dtype, device=first.device)
    start = h.rank * h.shard_numel
    end = start + h.shard_numel
    offset = 0
    for v, n in zip(vals, h.numels):
        lo, hi = max(offset, start), min(offset + n, end)
        if lo < hi:
            out[lo - start: hi - start].copy_(v.detach().reshape(-1)[lo - offset: hi - offset])
        offset += n
    return out


def _same(a: Any, b: Any) -> bool:
    """Whether two values of optimizer state are equal: tensors by value, lists, tuples and dicts item by item,
    anything else by its ``==``; an error raised by a value's own ``==`` propagates."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    eq = a == b
    if isinstance(eq, bool):
        return eq
    try:
        return bool(eq)
    except ValueError:
        # An element-wise result (a NumPy array's ==) has no single truth value: every element must agree.
        every = getattr(eq, "all", None)
        if not callable(every):
            raise
        return bool(every())


def _check_full_osd(full_osd: Any) -> dict[str, Any]:
    """The ``"shardfuse"`` entry of a consolidated dict, after checking that the dict is one."""
    missing = [k for k in _LAYOUT_KEYS if not isinstance(full_osd, dict) or k not in full_osd]
    if missing:
        raise ValueError(
            f"get_shard_from_optim_state_dict() needs a dict made by gather_full_optim_state_dict() (it lacks "
            f"{missing}; got {type(full_osd).__name__}): consolidate with model.gather_full_optim_state_dict(optim)"
        )
    meta = full_osd[_META_KEY]
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(
            f"get_shard_from_optim_state_dict(): the '{_META_KEY}' entry has format "
            f"{meta.get('format') if isinstance(meta, dict) else meta!r}, this version reads format {_FORMAT}: "
            f"consolidate again with this version's gather_full_optim_state_dict()"
        )
    return meta


def _check_names(saved_names: list[str], names: list[str]) -> None:
    if saved_names != names:
        diff = next((i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b), min(len(saved_names),
                                                                                            len(names)))
        raise ValueError(
            f"the consolidated optimizer state is for other parameters: {len(saved_names)} saved vs "
            f"{len(names)} here, first difference at index {diff} "
            f"({saved_names[diff] if diff < len(saved_names) else None!r} vs "
            f"{names[diff] if diff < len(names) else None!r}): load it into the model it was consolidated from"
        )


def _flats_by_entry(param_id_map: dict[int, int | None], flats: list[_Flat], names: list[str]
                    ) -> tuple[dict[int, list[int]], dict[int, _Flat]]:
    """Optimizer index -> the global ids it held, and -> this model's flat parameter made of exactly those."""
    by_gids = {tuple(sorted(f.gids)): f for f in flats}
    li_gids: dict[int, list[int]] = {}
    for g, li in sorted(param_id_map.items()):
        if li is not None:
            li_gids.setdefault(li, []).append(g)
    li_flat: dict[int, _Flat] = {}
    for li, gids in li_gids.items():
        f = by_gids.get(tuple(gids))
        if f is None:
            raise ValueError(
                f"optimizer entry {li} held the parameters {[names[g] for g in gids][:4]}..., which do not form a "
                f"flat group of this model: wrap the model the same way (the same modules in the same "
                f"FullyShardedDataParallel units) as when the state was consolidated"
            )
        li_flat[li] = f
    return li_gids, li_flat


def _check_entries(li: int, f: _Flat, entries: list[Any], pnames: list[str], per_elem: set[str]) -> None:
    """The original parameters of one flat parameter: the same state keys, per-element state of their sizes,
    one shared value of every other state."""
    if any(e is None for e in entries) or any(e.keys() != entries[0].keys() for e in entries):
        have = [n for n, e in zip(pnames, entries) if e is not None]
        raise ValueError(
            f"optimizer state is missing for some parameters of flat group {li} (state for {have[:4]}, keys "
            f"{[sorted(map(str, e)) for e in entries if e is not None][:2]}; the group holds {pnames[:8]}): "
            f"every original parameter of a flat group needs the same state keys; pass the dict "
            f"gather_full_optim_state_dict() returned, unedited"
        )
    for key, first in entries[0].items():
        vals = [e[key] for e in entries]
        if key in per_elem:
            _check_per_element(vals, f.handle, key, pnames)
            continue
        for n, v in zip(pnames[1:], vals[1:]):
            if not _same(first, v):
                raise ValueError(
                    f"optimizer state {key!r} is {v!r} for {n} but {first!r} for {pnames[0]}, which share one "
                    f"flat parameter and so one value: load a state dict consolidated from this model"
                )


def _shard_groups(root: nn.Module, full_osd: dict[str, Any], param_id_map: dict[int, int | None],
                  li_gids: dict[int, list[int]], li_flat: dict[int, _Flat]) -> list[dict[str, Any]]:
    """The param groups in optimizer indices of the flat parameters (keys in the saved order, as FairScale's)."""
    flat_names = {id(p): n for n, p in root.named_parameters()}
    groups = []
    for i, pg in enumerate(full_osd["param_groups"]):
        listed = {int(g) for g in pg["params"]}
        lis = sorted({param_id_map.get(g) for g in listed}, key=lambda x: (x is None, x or 0))
        if None in lis or any(g not in listed for li in lis for g in li_gids[li]):  # type: ignore[index]
            raise ValueError(
                f"param_groups[{i}] of the consolidated state lists {len(pg['params'])} parameters that do not make "
                f"whole flat parameters of this model (ids {list(pg['params'])[:8]}...): pass the dict "
                f"gather_full_optim_state_dict() returned, unedited"
            )
        new: dict[str, Any] = {}
        for k, v in pg.items():
            if k == "params":
                new[k] = lis
            elif k == "param_names":
                new[k] = [flat_names.get(id(li_flat[li].handle.flat), "") for li in lis]  # type: ignore[index]
            else:
                new[k] = copy.deepcopy(v)
        groups.append(new)
    return groups


@torch.no_grad()
def get_shard_from_optim_state_dict(root: nn.Module, full_osd: dict[str, Any]) -> dict[str, Any]:
    """See ``FullyShardedDataParallel.get_shard_from_optim_state_dict`` and the module docstring.

    Returns ``{"state", "param_groups"}`` (plus the extra top-level keys of the saved optimizer state dict) for
    ``optim.load_state_dict`` of an optimizer built with the same groups of flat parameters as the one that
    was consolidated; any world size, the same wrapping. No collectives.

    As in FairScale, ``full_osd`` is consumed: it is modified in place and returned (so the full state is never
    held twice); ``copy.deepcopy`` it first to keep it. A ``ValueError`` (wrong model, edited dict) is raised
    before anything is modified.
    Per-element state is this rank's padded shard on the device the full dict's tensors are on (the CPU, for
    a dict from :func:`gather_full_optim_state_dict`), as in FairScale; ``load_state_dict`` moves it to the
    parameters' device. A flat parameter's other state comes from its first original parameter.
    """
    _refuse_orig_params(units_below(require_unit(root)), "get_shard_from_optim_state_dict()")
    meta = _check_full_osd(full_osd)
    flats, names = _layout(root)
    _check_names(list(full_osd["param_names"]), names)
    param_id_map = {int(g): (None if li is None else int(li)) for g, li in full_osd["param_id_map"].items()}
    per_elem = {int(li): set(keys) for li, keys in meta.get("per_element", {}).items()}
    li_gids, li_flat = _flats_by_entry(param_id_map, flats, names)
    full_state = full_osd["state"]
    # First every check, so that an error leaves the input untouched; then the input is consumed.
    plan: list[tuple[int, _Flat, list[dict[str, Any]]]] = []
    for li in sorted(li_flat):
        f = li_flat[li]
        entries = [full_state.get(g) for g in f.gids]
        if any(e is not None for e in entries):
            _check_entries(li, f, entries, [names[g] for g in f.gids], per_elem.get(li, set()))
            plan.append((li, f, entries))
    groups = _shard_groups(root, full_osd, param_id_map, li_gids, li_flat)
    # Nothing below raises. As in FairScale, the input dict is consumed: each original parameter's state is
    # dropped once its flat shard exists (so the full state is not held twice), and the dict becomes the result.
    state: dict[int, dict[str, Any]] = {}
    for li, f, entries in plan:
        out: dict[str, Any] = {}
        for key, first in entries[0].items():
            if key in per_elem.get(li, ()):
                out[key] = _shard_slice([e[key] for e in entries], f.handle)
            else:
                out[key] = first.detach().clone() if isinstance(first, torch.Tensor) else copy.deepcopy(first)
        if f.handle.shard_mark is not None:
            out[SHARD_MARK_KEY] = f.handle.shard_mark  # as the optimizer's own state of this shard carries it
        state[li] = out
        for g in f.gids:
            full_state.pop(g, None)
    full_osd["state"] = state
    full_osd["param_groups"] = groups
    for k in _LAYOUT_KEYS[2:]:
        del full_osd[k]
    return full_osd
