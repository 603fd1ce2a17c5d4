"""What the user sees of an SSD-backed tensor while its values live in its file: a face that refuses to be read.

Between uses a shard of the SSD tier (and its offloaded optimizer state) is written to its file and its memory is
given back (its storage resized to 0 bytes) by an I/O thread, some time after the step that last used it. Any read
of such a tensor (``p.data.sum()``, ``print(p)``) would touch freed memory: a crash, or stale values, depending on
whether the I/O thread got there first. So the moment the tier stops using a tensor (and until it or a state-dict
path reads it in again), the tensor's class is switched to its *on-disk face*, a subclass of its own class (an
``nn.Parameter`` stays an ``nn.Parameter``) whose ``__torch_function__`` lets through only what reads no element:
its shape, dtype, device, gradient (gradients stay in memory), ``requires_grad``, hooks, its storage object (the
tier's own bookkeeping). Anything else raises a ``RuntimeError`` naming the tensor and the way to read it
(``summon_full_params()``, ``state_dict()``), on every rank, at once, whatever the I/O threads are doing.

Switching a class is one pointer write, paid twice per use; while the tier uses a tensor it has its own class back,
so the optimizer and the gathers run as without the tier (foreach/fused optimizers included). A reference taken
while the tensor was readable (``x = p.detach()``) is another holder of its storage; the tier does not give such a
storage back (:func:`held_elsewhere`), so the reference keeps valid memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardfuse._torch_private import storage_use_count

LABEL_ATTR = "_shardfuse_ssd_label"  # on a tensor: () -> (what it is, how to read it), for the error
Label = Callable[[], tuple[str, str]]

# Methods and attributes that read no element of the tensor (nor write one).
_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
    "is_pinned", "is_floating_point", "is_complex", "is_signed", "is_shared", "untyped_storage", "data_ptr",
    "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "__len__", "__hash__", "__dir__", "_is_view",
})
_GETTERS = frozenset({
    "shape", "dtype", "device", "layout", "requires_grad", "grad", "_grad", "is_leaf", "retains_grad", "grad_fn",
    "_grad_fn", "_version", "ndim", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "itemsize", "nbytes", "_base", "_backward_hooks", "_post_accumulate_grad_hooks",
})
_SETTERS = frozenset({"grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"})


def _what(func: Any) -> tuple[str, bool]:
    """How the user's call reads in an error, and whether it may run on a tensor on disk."""
    name = getattr(func, "__name__", "") or repr(func)
    if name in ("__get__", "__set__", "__delete__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "?")
        if name == "__get__":
            return f"reading .{attr}", attr in _GETTERS
        return f"setting .{attr}", name == "__set__" and attr in _SETTERS
    return f"{name}()", name in _METHODS


def _labelled(args: Iterable[Any]) -> tuple[str, str] | None:
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) in _BASE_OF:
            label = a.__dict__.get(LABEL_ATTR)
            return label() if label is not None else ("a tensor of the SSD offload tier", "read it after its use")
        if isinstance(a, (list, tuple)):
            found = _labelled(a)
            if found is not None:
                return found
    return None


def _on_disk_torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    what, allowed = _what(func)
    if allowed:  # torch's own handling, as for a plain tensor (results are not made faces)
        return torch.Tensor.__torch_function__(func, (torch.Tensor,), args, kwargs or {})
    label, fix = _labelled([*args, *(kwargs or {}).values()]) or ("a tensor", "")
    raise RuntimeError(
        f"{label}: its values live on disk between uses (SSD offload tier, OffloadConfig(offload_type="
        f"'ssd_offload')), so {what} cannot read or write it here: {fix}"
    )


_FACE_OF: dict[type, type] = {}  # a tensor class -> its on-disk face (classes only: nothing live is kept)
_BASE_OF: dict[type, type] = {}  # the face -> the class it stands for


_FACES_LOCK = threading.Lock()  # making a face: two threads hiding tensors of a new class make one face


def _face_of(base: type) -> type:
    face = _FACE_OF.get(base)
    if face is None:
        with _FACES_LOCK:
            face = _FACE_OF.get(base)
            if face is None:
                face = type(f"{base.__name__}OnDisk", (base,), {
                    "__module__": __name__,
                    "__torch_function__": classmethod(_on_disk_torch_function),
                    "__doc__": f"A {base.__name__} of the SSD offload tier whose values are on disk (see {__name__}).",
                })
                _BASE_OF[face] = base
                _FACE_OF[base] = face
    return face


def hide(tensors: Iterable[tuple[torch.Tensor, Label]]) -> None:
    """From now on reading each tensor raises, naming it by its label: (what it is, how to read it instead)."""
    for t, label in tensors:
        cls = type(t)
        if cls not in _BASE_OF:
            t.__class__ = _face_of(cls)
        t.__dict__[LABEL_ATTR] = label


def show(tensors: Iterable[tuple[torch.Tensor, Any]]) -> None:
    """Each tensor is itself again (its memory holds its values)."""
    for t, _ in tensors:
        base = _BASE_OF.get(type(t))
        if base is not None:
            t.__class__ = base


def on_disk(t: torch.Tensor) -> bool:
    """``t`` wears its on-disk face (reading it raises)."""
    return type(t) in _BASE_OF


def held_elsewhere(t: torch.Tensor, known: int) -> bool:
    """Some tensor besides the ``known`` ones (``t`` and its views) holds ``t``'s storage: a reference taken while
    it was readable, or an operation still running on it. Giving that storage back would leave it dangling."""
    count = storage_use_count(t.untyped_storage())
    return count is not None and count > known + 1  # + the storage object made to ask
