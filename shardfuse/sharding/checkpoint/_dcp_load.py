"""Reading a ``torch.distributed.checkpoint`` (DCP) checkpoint without running code from it.

torch's own reader and planner unpickle parts of a checkpoint with full pickle: ``FileSystemReader`` its
``.metadata`` file (``pickle.load``), ``DefaultLoadPlanner`` every non-tensor entry (``torch.load(...,
weights_only=False)``). A crafted checkpoint therefore runs its code inside ``dcp.load``, before shardfuse sees
anything. :class:`SafeFileSystemReader` reads the metadata with an unpickler that rebuilds only DCP's own metadata
classes (and the torch sizes, dtypes and paths they hold), and :class:`SafeLoadPlanner` reads non-tensor entries
with torch's weights-only unpickler (tensors, numbers, strings, None, lists, tuples, dicts): anything else is
refused with an error naming the entry and the opt-in, ``trust_checkpoint=True``. Tensors DCP already reads with
``weights_only=True``.

    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardfuse.sharding.checkpoint._dcp_layout import KIND, META_KEY, MODEL, UnsafeCheckpointError, refusal

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Globals a DCP metadata file refers to besides the classes of _METADATA_MODULE: each builds plain data.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}
_PLANNER_HINT = ("SafeLoadPlanner(trust_checkpoint=True) (torch's DefaultLoadPlanner does the same), which "
                 "unpickles it with weights_only=False and so runs whatever code it carries")
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Full pickle's machinery with the globals limited to what DCP's metadata is made of (the standard
    library's "restricting globals" pattern): a checkpoint naming any other function or class is refused."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        obj = super().find_class(module, name) if module in (_METADATA_MODULE, "torch") else None
        if module == _METADATA_MODULE and isinstance(obj, type) and obj.__module__ == _METADATA_MODULE:
            return obj
        if module == "torch" and isinstance(obj, _TORCH_CONSTANTS):
            return obj
        raise UnsafeCheckpointError(
            f"checkpoint metadata {self.path!r} refers to {module}.{name}, which is not part of DCP's metadata: a "
            f"pickle that names it can run code when loaded, and nothing of it was run. Load it only from a "
            f"checkpoint you trust, with SafeFileSystemReader(path, trust_checkpoint=True) (or torch's own "
            f"FileSystemReader), which unpickles it fully; see docs/troubleshooting.md, 'Loading checkpoints you did "
            f"not write'"
        )


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` file is unpickled with DCP's metadata classes only (no
    code can run), unless ``trust_checkpoint=True``. Pass it as ``dcp.load(..., storage_reader=...)``."""

    def __init__(self, path: str | os.PathLike, *args: Any, trust_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.trust_checkpoint = trust_checkpoint

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as f:
            metadata = pickle.load(f) if self.trust_checkpoint else _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(
                f"{path!s} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata: point "
                f"checkpoint_id at a directory that dcp.save wrote"
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def check_wrapping(state_dict: Mapping[str, Any], metadata: Any) -> None:
    """Before DCP plans the reads of a dict that ``sharded_state_dict()`` made: the checkpoint's flat parameters
    must be this model's, with the same sizes; otherwise the wrapping differs, which is said here with the sizes
    and names (torch would only say "Size mismatch" or "Missing key"). Other dicts pass untouched."""
    saved = getattr(metadata, "state_dict_metadata", None)
    text = state_dict.get(META_KEY)
    try:
        meta = json.loads(text) if isinstance(text, str) and isinstance(saved, Mapping) else None
    except ValueError:
        return  # not shardfuse's entry: load_sharded_state_dict says so later
    if not isinstance(meta, dict) or meta.get("kind") != KIND or not isinstance(meta.get("flat_params"), dict):
        return
    assert isinstance(saved, Mapping)  # checked above, with the text
    flats = {MODEL + k: (v.get("numel"), list(v.get("names", []))) for k, v in meta["flat_params"].items()}
    saved_flats = {k: tuple(getattr(md, "size", ())) for k, md in saved.items()
                   if k.startswith(MODEL) and k.rsplit(".", 1)[-1].startswith("flat_param_")}
    sizes = [f"{k}: {saved_flats[k][0] if saved_flats[k] else '?'} elements in the checkpoint, {numel} here "
             f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for k, (numel, names) in flats.items() if k in saved_flats and saved_flats[k] != (numel,)]
    only_here = [k for k in flats if k not in saved_flats]
    only_saved = [k for k in saved_flats if k not in flats]
    if sizes or only_here:
        raise ValueError(
            f"dcp.load of sharded_state_dict(): the checkpoint was saved from another wrapping of the model: flat "
            f"parameters of other sizes {sizes[:4]}, only in this model {only_here[:4]}, only in the checkpoint "
            f"{only_saved[:4]}: wrap the model the same way as when it was saved (the same modules in the same "
            f"FullyShardedDataParallel units, the same dtypes and requires_grad); only the world size may change"
        )


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that reads non-tensor entries with torch's weights-only unpickler (no code
    can run), unless ``trust_checkpoint=True``, and, for a dict that ``sharded_state_dict()`` made, tells a
    checkpoint of another wrapping apart before planning (:func:`check_wrapping`). Pass it as
    ``dcp.load(..., planner=...)``."""

    def __init__(self, *args: Any, trust_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_checkpoint = trust_checkpoint

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        check_wrapping(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if not self.trust_checkpoint:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise refusal(fqn, err, _PLANNER_HINT) from None
            value = io.BytesIO()
            torch.save(obj, value)  # checked: the same plain data, for torch's own placement into the dict
            value.seek(0)
        super().load_bytes(read_item, value)

