"""What a checkpoint's files should hold: the size and sha256 of every file, recorded in its meta.json (`files`)
when it is published, and checked before anything of it is loaded (checkpoint_io.verify). A flipped bit in a weight
loads without complaint, so only a hash of the bytes tells; sha256 is the standard library's fastest strong hash
on CPUs with SHA instructions, and `sha256sum` prints the same digests (benchmarks/RESULTS.md, "Checkpoint hashes").

A file listed but absent, a different one, or one that is not listed (it would be read unverified: model.pt beside
model_dcp/ wins, say) makes the checkpoint unloadable, and so does a symlink anywhere in it (first_symlink) or a
listed file that is not a regular one (a FIFO would block its hash forever). meta.json itself is not listed: it is
written last, holding the list.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from core.errors import Unloadable, unreadable

CHUNK = 1 << 20  # bytes read at a time: large enough that the hash, not Python, sets the pace
MAX_OPEN = 8  # files hashed (so open) at once, whatever the machine: a run under a low `ulimit -n` still saves
HEX = re.compile(r"^[0-9a-f]{64}$")


def hash_file(path: str) -> str:
    """sha256 of the file at `path`, as 64 hex digits."""
    digest, buffer = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def hash_files(paths: list[str]) -> list[str]:
    """hash_file of each path, several at a time: hashlib lets go of the GIL, so files (a DCP folder's shards,
    model.pt beside optimizer.pt) are hashed on as many cores as there are files, up to MAX_OPEN."""
    if len(paths) < 2:
        return [hash_file(p) for p in paths]
    with ThreadPoolExecutor(min(MAX_OPEN, os.cpu_count() or 1, len(paths))) as pool:
        return list(pool.map(hash_file, paths))


def listed_files(folder: str) -> list[str]:
    """Every file under `folder` but its meta.json, as sorted paths relative to it with '/' between parts."""
    found = (os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
             for parent, _, files in os.walk(folder, onerror=_raise) for name in files)
    return sorted(rel for rel in found if rel != "meta.json")


def first_symlink(folder: str) -> Optional[str]:
    """The first symlink (to a file or a folder) at any depth under `folder`, or None. os.walk does not follow
    them, so a linked folder would be neither listed nor hashed, yet read by a loader that opens its path."""
    for parent, dirs, files in os.walk(folder, onerror=_raise):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(parent, name)):
                return os.path.join(parent, name)
    return None


def _raise(error: OSError):
    raise error  # os.walk would skip a folder it cannot list: its files would look missing


def record(folder: str) -> dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": hex}} of every file in the finished checkpoint folder `folder`."""
    names = listed_files(folder)
    digests = hash_files([os.path.join(folder, rel) for rel in names])
    return {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)), "sha256": digest}
            for rel, digest in zip(names, digests)}


def problem(folder: str, files) -> Optional[str]:
    """What differs between checkpoint folder `folder` and `files`, its meta.json's record (untrusted: checked
    first): one line naming the file, or None if nothing does (a file the machine cannot read: CheckpointError). Sizes and names are compared before any file is
    hashed, so a missing or truncated file is said at once."""
    malformed = _malformed(files)
    if malformed:
        return f"{os.path.join(folder, 'meta.json')}: unreadable (`files` {malformed})"
    try:
        link = first_symlink(folder)
        return symlink_refused(link) if link else _difference(folder, files)
    except OSError as e:  # a file gone meanwhile is a problem; a failing disk or no permission raises (unreadable)
        error = unreadable(e, folder)
        if not isinstance(error, Unloadable):
            raise error from None
        return str(error)


def symlink_refused(link: str) -> str:
    return f"{link}: a symlink inside the checkpoint (refused: it is never followed; a checkpoint holds its own " \
           "files only)"


def linked_checkpoint_refused(path: str) -> str:
    """The line for a checkpoint named by a path that is itself a symlink (train.resume, test.checkpoint, ...)."""
    return f"{path}: a symlink to a checkpoint (refused: it is never followed; a checkpoint is read from its own " \
           "folder)"


def _difference(folder: str, files: dict) -> Optional[str]:
    present = set(listed_files(folder))
    for rel, entry in files.items():
        full = os.path.join(folder, rel)
        if rel not in present:
            return f"{full}: missing from the checkpoint (meta.json lists it)"
        if not stat.S_ISREG(os.lstat(full).st_mode):  # a FIFO would block the hash's open() forever
            return f"{full}: not a regular file (a FIFO, socket or device: refused, never opened; a checkpoint " \
                   "holds its own files only)"
        size = os.path.getsize(full)
        if size == 0 and entry["bytes"]:
            return f"{full}: empty (0 bytes)"
        if size < entry["bytes"]:
            return f"{full}: truncated ({size} of {entry['bytes']} bytes)"
        if size != entry["bytes"]:
            return f"{full}: {size} bytes, but meta.json says {entry['bytes']} (the file changed after it was saved)"
    extra = sorted(present - set(files))
    if extra:
        return f"{os.path.join(folder, extra[0])}: not in meta.json's list of files (added after the checkpoint " \
               f"was saved; remove it)" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
    digests = hash_files([os.path.join(folder, rel) for rel in files])
    for (rel, entry), digest in zip(files.items(), digests):
        if digest != entry["sha256"]:
            return f"{os.path.join(folder, rel)}: sha256 differs from meta.json (the file changed after it was saved)"
    return None


def _malformed(files) -> str:
    """What is wrong with a `files` record read from meta.json ("" if nothing): each name must stay inside the
    checkpoint folder (it becomes a path that is opened) and each entry hold a size and a sha256."""
    if not isinstance(files, dict):
        return f"is a {type(files).__name__}, not an object"
    for rel, entry in files.items():
        if rel == "meta.json" or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
            return f"names {rel[:60]!r}, not a file inside the checkpoint"
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and
                not isinstance(entry["bytes"], bool) and entry["bytes"] >= 0 and
                isinstance(entry.get("sha256"), str) and HEX.match(entry["sha256"])):
            return f"entry {rel[:60]!r} is {str(entry)[:60]}, not {{\"bytes\": size, \"sha256\": 64 hex digits}}"
    return ""
