"""torch.distributed.checkpoint folders, read without running code: DCP itself unpickles `.metadata` with plain
pickle.load (FileSystemReader.read_metadata) and the non-tensor entries with torch.load(weights_only=False)
(DefaultLoadPlanner.load_bytes); both are replaced here, and each byte is read once, by a loader that runs no
code. Imported by fsdp and pipe runs and by runs that read one.
"""
from __future__ import annotations

import functools
import os
import pathlib
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from core.errors import CheckpointError, Unloadable, first_line, unreadable


def dcp_cause(e: BaseException) -> BaseException:
    """DCP wraps what failed into a CheckpointException holding each rank's (exception, traceback): the first
    rank's exception. Any other exception is its own cause."""
    return next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e


def dcp_load(state_dict: dict, dcp_dir: str) -> None:
    """dcp.load(state_dict) from the folder `dcp_dir` (collective), refusing anything in it that would run code."""
    read_dcp_metadata(dcp_dir)  # a refusal here is one line, on every rank, before DCP's collectives
    dcp.load(state_dict, storage_reader=_reader(dcp_dir), planner=_planner(dcp_dir))


def dcp_model_state_dict(dcp_dir: str) -> dict:
    """Assemble the shards of a torch.distributed.checkpoint folder (fsdp) into one plain state dict, in this
    process, without a process group: its keys are the plain model's parameter names."""
    read_dcp_metadata(dcp_dir)
    state_dict = {}
    try:  # what torch's format_utils.dcp_to_torch_save does, with the checked reader and planner
        _load_state_dict(state_dict, storage_reader=_reader(dcp_dir), planner=_planner(dcp_dir, empty=True),
                         no_dist=True)
    except (Exception, CheckpointException) as e:  # missing shard files, truncated ones, ...
        cause = dcp_cause(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        if isinstance(cause, OSError):  # a shard the machine cannot read, or one gone (unreadable)
            raise unreadable(cause, dcp_dir) from None
        raise Unloadable(f"{dcp_dir}: cannot be read as a sharded checkpoint ({first_line(cause)})") from None
    return state_dict


def read_dcp_metadata(dcp_dir: str, name: str = ".metadata"):
    """The Metadata object of a DCP folder, unpickled with only DCP's metadata classes (and the torch values in
    them) allowed: a crafted file that would import anything else is refused before anything of it runs."""
    full = os.path.join(dcp_dir, name)
    if not os.path.isfile(full):
        raise Unloadable(f"{full}: missing from the checkpoint")
    try:
        f = open(full, "rb")
    except OSError as e:
        raise unreadable(e, full) from None
    with f:
        try:
            metadata = _MetadataUnpickler(f, full).load()
        except CheckpointError:
            raise
        except OSError as e:  # no permission, a failing disk: not the file's bytes (unreadable)
            raise unreadable(e, full) from None
        except Exception as e:  # empty, truncated, not a pickle
            raise Unloadable(f"{full}: cannot be loaded ({first_line(e)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Unloadable(f"{full}: cannot be loaded (a {type(metadata).__name__}, not DCP metadata)")
    # The shard files it lists must hold what it says they hold; checked here, a missing or truncated one is
    # named in one line before DCP's collectives start, instead of failing inside them without a file name.
    need = {}
    for info in metadata.storage_data.values():
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and name == os.path.basename(name) and isinstance(offset, int)
                and isinstance(length, int)):  # DCP writes the names of files next to .metadata
            raise Unloadable(f"{full}: cannot be loaded (malformed storage entry {str(info)[:100]})")
        need[name] = max(need.get(name, 0), offset + length)
    for name, size in sorted(need.items()):
        shard = os.path.join(dcp_dir, name)
        if not os.path.isfile(shard):
            raise Unloadable(f"{shard}: missing from the checkpoint")
        if os.path.getsize(shard) < size:
            raise Unloadable(f"{shard}: truncated ({os.path.getsize(shard)} of {size} bytes)")
    return metadata


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        allowed = _metadata_globals()
        if (module, name) not in allowed:
            raise Unloadable(f"{self.path}: refused: it would import {module}.{name} (a checkpoint must never run "
                             f"code)")
        return allowed[module, name]


@functools.cache
def _metadata_globals() -> dict:
    """Everything a DCP `.metadata` may name, as real fsdp checkpoints do: DCP's metadata classes (dataclasses
    and one enum), the storage info of its file reader, torch.Size, dtypes, layouts (by name, through torch's own
    lookup) and the checkpoint's path. None of them runs code other than storing its arguments."""
    allowed = {(dcp.metadata.__name__, n): v for n, v in vars(dcp.metadata).items()
               if isinstance(v, type) and v.__module__ == dcp.metadata.__name__}
    allowed[dcp.filesystem.__name__, "_StorageInfo"] = dcp.filesystem._StorageInfo
    allowed["torch", "Size"] = torch.Size
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    for module in ("pathlib", "pathlib._local"):  # where Python <= 3.12 and >= 3.13 define the path classes
        allowed.update({(module, n): getattr(pathlib, n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                                                   "PurePosixPath", "PureWindowsPath")})
    return allowed


def _reader(dcp_dir: str):
    """DCP's file reader, unpickling `.metadata` with _MetadataUnpickler instead of pickle.load."""
    class NoCodeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # FileSystemReader.read_metadata, but for the unpickler
            path = self._get_metadata_path(kwargs.get("rank"))
            metadata = read_dcp_metadata(os.path.dirname(path), os.path.basename(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return NoCodeReader(dcp_dir)


def _planner(dcp_dir: str, empty: bool = False):
    """DCP's load planner (`empty`: the one that loads every entry into an empty dict), whose entries that are
    not tensors are read once, by torch's weights-only unpickler (DCP's own reads them with weights_only=False);
    what it would import, if anything, is named first."""
    class NoCodePlanner(_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DefaultLoadPlanner.load_bytes, with the weights-only load
            entry = f"{dcp_dir}: entry {read_item.dest_index.fqn}"
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(value)
                value.seek(0)
                loaded = None if unsafe else torch.load(value, weights_only=True)
            except Exception as e:  # not a torch.save file, truncated, ...
                raise Unloadable(f"{entry}: cannot be loaded ({first_line(e)})") from None
            if unsafe:
                raise Unloadable(f"{entry}: refused: it would import {unsafe[0]} (a checkpoint must never run code)")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded
    return NoCodePlanner()
