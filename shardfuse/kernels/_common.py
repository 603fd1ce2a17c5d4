"""Shared plumbing for the kernel families: dispatch, argument checks, launch-plan keys and pointer tables.

Every public kernel validates with these helpers so that the error messages read the same everywhere:
they name the offending value and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar, overload

import torch
import triton
import triton.language as tl

from shardfuse.kernels import _crossover

# Dtypes the kernels read and write. Integer and complex tensors are rejected with a clear error.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# Elements per program for the streaming kernels: 16-byte vectors for every dtype, several in flight.
BLOCK_SIZE = 4096
NUM_WARPS = 8  # BLOCK_SIZE over 256 threads: 16 elements each, several 16-byte vectors in flight per thread
MIN_MULTI_BLOCK = 512  # smallest block of a multi-tensor launch (tiny tensors waste fewer masked lanes)


def multi_block(numels: Sequence[int]) -> tuple[int, int]:
    """(block, num_warps) of a multi-tensor launch: the largest tensor rounded up to a power of two, between
    MIN_MULTI_BLOCK and BLOCK_SIZE, so that many tiny tensors waste fewer lanes (one compile per power of two)."""
    block = min(BLOCK_SIZE, max(MIN_MULTI_BLOCK, 1 << (max(numels) - 1).bit_length()))
    return block, NUM_WARPS if block >= 2048 else 4


def scale_args(factor: float) -> tuple[float, bool, bool]:
    """(kernel factor, DIVIDE, MULTIPLY) for the kernels' :func:`apply_scale` of ``x / factor``.

    Dividing by a power of two is multiplying by its reciprocal, exactly: both round the same real value
    ``x * 2**-k`` once. A multiply is one instruction where IEEE division (``div_rn``) is a dozen, which is
    what bounds the 2-byte kernels. Only where the reciprocal is a normal fp32 number; else true division.
    """
    if factor == 1.0:
        return factor, False, False
    mantissa, _ = math.frexp(factor)
    inv = 1.0 / factor
    if mantissa == 0.5 and 2.0**-126 <= inv <= 2.0**127:
        return inv, True, True
    return factor, True, False


@triton.jit
def apply_scale(x, factor, DIVIDE: tl.constexpr, MULTIPLY: tl.constexpr):
    """``x / factor`` in fp32 as :func:`scale_args` set it up (``factor`` is the reciprocal if MULTIPLY)."""
    if DIVIDE:
        if MULTIPLY:
            x = x * factor
        else:
            x = tl.math.div_rn(x, factor)
    return x


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """True when Triton's CPU interpreter is asked for (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Pick the Triton path: always on CUDA tensors, on CPU tensors only under the interpreter."""
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting() and all(t.device.type == "cpu" for t in tensors)


def triton_device(t: torch.Tensor) -> bool:
    """What :func:`use_triton` would say from one tensor alone: the O(1) test the PyTorch-op branches take
    before anything else is looked at (the op itself rejects tensors on other devices)."""
    return t.is_cuda or (interpreting() and t.device.type == "cpu")


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor: pass a tensor")


_E = TypeVar("_E")


@overload
def as_list(items: Sequence[_E]) -> list[_E]: ...
@overload
def as_list(items: Any) -> Any: ...
def as_list(items: Any) -> Any:
    """``items`` as a list when it is an iterable other than a tensor, else as given: the fast paths take
    lists, and the validating path then says what is wrong with anything else. A list is not copied."""
    if type(items) is list:
        return items
    return list(items) if isinstance(items, Iterable) and not isinstance(items, torch.Tensor) else items


def check_tensors(items: Any, name: str, caller: str | None = None) -> list[torch.Tensor]:
    """``items`` (argument ``name`` of ``caller``) as a list, every entry a tensor; a TypeError names the
    first entry that is not."""
    if isinstance(items, torch.Tensor) or not isinstance(items, Iterable):
        what = f"{caller} takes" if caller else f"{name} must be"
        raise TypeError(f"{what} a sequence of tensors, got a {type(items).__name__}: wrap it in a list")
    items = list(items)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] is a {type(t).__name__}, not a torch.Tensor: pass tensors only")
    return items


def check_float(t: torch.Tensor, name: str) -> None:
    check_tensor(t, name)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype}; shardfuse kernels take {list(FLOAT_DTYPES)}: "
            f"cast it first (e.g. {name}.float())"
        )


def check_dtype_arg(dtype: Any) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}: pass e.g. dtype=torch.bfloat16")


def check_same_device(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        where = ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"all tensors must be on one device, got {where}: move them with .to(device) first")
    return tensors[0].device


def check_out(out: torch.Tensor, numel: int, name: str = "out") -> None:
    """``out`` must be contiguous and hold at least ``numel`` elements."""
    check_float(out, name)
    if not out.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape={tuple(out.shape)} stride={out.stride()}): "
            f"pass a contiguous buffer or {name}.contiguous()"
        )
    if out.numel() < numel:
        raise ValueError(f"{name} is too small: {name}.numel()={out.numel()} < required {numel}")


def check_world_size(world_size: Any, caller: str) -> int:
    """``world_size`` as an int >= 1 (Python or NumPy integers; not bools, floats or strings)."""
    try:
        valid = not isinstance(world_size, bool) and operator.index(world_size) >= 1
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(
            f"{caller} needs an integer world_size >= 1, got {world_size=!r}: world_size is the number of "
            f"ranks and must be a positive int"
        )
    return operator.index(world_size)


def check_factor(factor: Any) -> float:
    """A divide factor as a float: a finite number > 0 (not a bool or a string, which ``float()`` accepts)."""
    try:
        value = float(factor) if not isinstance(factor, (bool, str, bytes)) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"the divide factor must be a finite number > 0, got {factor=!r}: use 1.0 for no division")
    return value


# --------------------------------------------------------------------------------------------------
# Launch plans: keys and cache
# --------------------------------------------------------------------------------------------------

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_T = torch.Tensor


def guarded_key(tensors: list[torch.Tensor], *parts: Any) -> tuple | None:
    """The plan-cache key of a call whose plan holds a :func:`layout_guard` of ``tensors`` (every tensor it reads
    and writes, all on one device once validated): the current CUDA stream (0 on CPU), the dispatch overrides
    in force, ``parts``, and the tensors' addresses alone; their other fields are the guard's to check, at a
    fraction of the cost of reading them here. None while a CUDA graph is being captured (a captured table copy
    has not run yet, and a cached table could be freed while the graph still reads it) and for malformed
    arguments (the validating path says what is wrong). One function, no layers: this runs on every call of a
    dispatching entry point, whose PyTorch path is a few microseconds of host time."""
    try:
        first = tensors[0]
        if first.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return None
            stream = torch._C._cuda_getCurrentRawStream(first.get_device())
        else:
            stream = 0
        return (stream, _crossover._token, parts, tuple(map(_T.data_ptr, tensors)))
    except (TypeError, AttributeError, IndexError, RuntimeError):  # e.g. a tensor with no storage to address
        return None  # no key: the validating path says what is wrong


# PyTorch's C++ check of tensor metadata, the one torch.compile's guards run; private, so with a fallback.
try:
    from torch._C._dynamo import guards as _dynamo_guards

    _TensorGuards: Any = getattr(_dynamo_guards, "TensorGuards", None)
except ImportError:  # pragma: no cover - a PyTorch built without dynamo
    _TensorGuards = None

_STRIDE = _T.stride
_DEVICE = operator.attrgetter("device")


def _layout_fields(tensors: Sequence[torch.Tensor]) -> tuple:
    return (*map(type, tensors), *map(_SHAPE, tensors), *map(_STRIDE, tensors), *map(_DTYPE, tensors),
            *map(_DEVICE, tensors))


class _FieldGuard:
    """:func:`layout_guard` in Python: the tensors' types, shapes, strides, dtypes and devices, read again."""

    __slots__ = ("_fields",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._fields = _layout_fields(tensors)

    def check(self, *tensors: torch.Tensor) -> bool:
        try:
            return _layout_fields(tensors) == self._fields
        except (TypeError, AttributeError):
            return False


def layout_guard(tensors: Sequence[torch.Tensor], *, native: bool = True) -> Callable[..., bool]:
    """``check(*same_count_of_tensors) -> bool``: whether each tensor has the Python type, shape, strides, dtype
    and device (and requires_grad and dispatch keys) that ``tensors`` have now. With the addresses in the plan
    key (:func:`guarded_key`), it pins down every byte a plan reads and writes, so a tensor whose storage, shape,
    strides, dtype or device changed never finds a plan built for another (a failed check is a miss: the call
    validates and builds again). Anything else that fails it (another requires_grad, an inference-mode call) only
    costs a rebuild.

    The check is ``torch._C._dynamo.guards.TensorGuards`` given every size and stride (a None there would leave
    that dimension unchecked): one C++ call, about as cheap for all the tensors as one attribute read of each in
    Python. Where PyTorch lacks it, or it does not accept these tensors (``native=False`` forces this), the same
    fields are read in Python. It must be given as many tensors as it was built from (the key's addresses fix the
    count): TensorGuards raises otherwise.
    """
    if native and _native_guards_work():
        try:
            guards = _native_guards(tensors)
            if guards.check(*tensors):
                return guards.check
        except Exception:  # noqa: BLE001 - a private API whose signature may change: the Python fields then
            pass
    return _FieldGuard(tensors).check


def _native_guards(tensors: Sequence[torch.Tensor]) -> Any:
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])


@functools.cache
def _native_guards_work() -> bool:
    """Whether this PyTorch's TensorGuards, as :func:`layout_guard` builds it, tells apart what the plans need
    (another size, strides, dtype): checked once, so that a private API that changed meaning falls back to Python."""
    if _TensorGuards is None:
        return False
    try:
        t = torch.zeros(2, 3)
        check = _native_guards([t]).check
        others = (t.view(3, 2), t.t(), t[:, :2], t.view(torch.int32))
        return bool(check(t)) and not any(check(o) for o in others)
    except Exception:  # noqa: BLE001 - see layout_guard
        return False


class PlanCache:
    """A small LRU cache of launch plans (device metadata tables plus launch arguments).

    The FSDP data path calls every launcher with the same tensors each iteration, so a plan keyed by the
    tensors' (address, size, dtype, layout, device) and the current stream lets a repeat call skip the
    validation that depends only on those (overlap checks included), the table building and the
    host->device copy. Plans are never mutated once stored: a kernel still in flight may be reading a
    plan's table (one exception: the source-address column of ``pre_divide_pad``'s list plans, rewritten by a launch
    queued on the plan's own stream behind the kernels that read it, ``_grad_divide_multi._Sources``). Keys hold
    only ints, dtypes and devices, never tensors, so the cache keeps no user memory alive. A table is used only on
    the stream it was copied on, so when an evicted table is freed, the caching allocator hands its block out only
    to later work on that stream. Every plan has a ``device``.
    """

    def __init__(self, maxsize: int = 64) -> None:
        self.maxsize = maxsize
        # hash(key) -> (key, plan): a key is a tuple of thousands of values whose hash Python does not
        # cache, so hash it once per call (an int key makes the LRU bookkeeping cheap); a colliding key
        # only costs a rebuild.
        self._plans: OrderedDict[int, tuple[Hashable, Any]] = OrderedDict()
        # The (key, plan) stored or found last: the most recently used entry, so a call repeating the previous
        # one finds it with one comparison (no hashing, no lock) and leaves the LRU order as it is, right.
        self._last: tuple[Hashable, Any] | None = None
        self._lock = threading.Lock()
        _CACHES.append(self)

    def __len__(self) -> int:
        return len(self._plans)

    def _find(self, key: Hashable | None) -> Any:
        """The value stored under ``key`` (marked most recently used), or None."""
        if key is None:
            return None
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        try:
            h = hash(key)
        except TypeError:
            return None  # an unhashable argument in the key (a list for an int): the validating path explains
        with self._lock:
            entry = self._plans.get(h)
            if entry is None or entry[0] != key:
                return None
            self._plans.move_to_end(h)
            self._last = entry
            return entry[1]

    def _store(self, key: Hashable | None, make: Callable[[Any], Any]) -> None:
        """Store ``make(value stored under key now, or None)`` under ``key`` as its newest entry. Stored values are
        never changed afterwards (a kernel in flight may read a plan's table): ``make`` builds a new one."""
        if key is None:
            return
        try:
            h = hash(key)
        except TypeError:
            return
        with self._lock:
            entry = self._plans.get(h)
            self._plans[h] = entry = (key, make(entry[1] if entry is not None and entry[0] == key else None))
            self._plans.move_to_end(h)
            while len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)
            self._last = entry if h in self._plans else None

    def get(self, key: Hashable | None) -> Any:
        """The plan stored under ``key``; None if there is none, or if it was built for the interpreter on
        CPU tensors and the interpreter has been switched off since (the reference path runs then)."""
        plan = self._find(key)
        return plan if plan is not None and (plan.device.type == "cuda" or interpreting()) else None

    def put(self, key: Hashable | None, plan: Any) -> None:
        self._store(key, lambda _old: plan)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._last = None


class GuardedPlanCache(PlanCache):
    """A :class:`PlanCache` of plans keyed by :func:`guarded_key` (addresses), each with a ``check`` (its
    :func:`layout_guard`). Up to ``layouts`` plans share a key, newest first, and a lookup returns the first whose
    check passes: tensors that the caching allocator hands out at the same addresses with other shapes (one layer's
    activations after another's) keep a plan each rather than evicting each other's on every call."""

    def __init__(self, maxsize: int = 64, layouts: int = 4) -> None:
        super().__init__(maxsize)
        self.layouts = layouts

    def get(self, key: Hashable | None, guarded: Any = ()) -> Any:
        """The plan under ``key`` built for tensors laid out as ``guarded`` are now (every tensor the call reads
        and writes, as given to :func:`guarded_key`); None as :meth:`PlanCache.get` says, or if no plan's check
        passes."""
        for plan in self._find(key) or ():
            if plan.check(*guarded):
                return plan if plan.device.type == "cuda" or interpreting() else None
        return None

    def put(self, key: Hashable | None, plan: Any) -> None:
        """Store ``plan`` (with its ``check``) first among the plans under ``key``, dropping the oldest past
        ``layouts``."""
        self._store(key, lambda older: (plan, *(older or ())[: self.layouts - 1]))


_CACHES: list[PlanCache] = []


def clear_plan_caches() -> None:
    """Drop every cached launch plan (and its device tables)."""
    for cache in _CACHES:
        cache.clear()


# --------------------------------------------------------------------------------------------------
# Metadata tables
# --------------------------------------------------------------------------------------------------


def _host_int64(values: Sequence[int]) -> torch.Tensor:
    # array() converts a list of ints about ten times faster than torch.tensor(list).
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the pinned block
    # alive until the copy on the current stream has finished.
    return host.pin_memory().to(device, non_blocking=True)


def block_table(columns: Sequence[Sequence[int]], block_counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """The metadata table of a multi-tensor launch: T-long int64 columns one after the other, then the
    owning tensor's index for every program (``sum(block_counts)`` entries).

    The owner column lets each program find its tensor with one load, where a binary search over block
    starts would make log2(T) dependent loads before the first byte of data moves.
    """
    flat: list[int] = []
    for col in columns:
        flat.extend(col)
    counts = _host_int64(block_counts)
    owners = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), counts)
    return to_device(torch.cat([_host_int64(flat), owners]), device)


def block_starts(block_counts: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: the first program of each tensor."""
    starts, pos = [], 0
    for c in block_counts:
        starts.append(pos)
        pos += c
    return starts


_NULL_CONTEXT = contextlib.nullcontext()


def device_guard(device: torch.device):
    """Make ``device`` current for a Triton launch (Triton launches on the current CUDA device)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _NULL_CONTEXT
    return torch.cuda.device(device)
