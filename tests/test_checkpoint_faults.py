"""Checkpoints survive anything (issue 9, items 5 and 6): durable writes, safe pruning, stale directories removed,
resume=auto falling back past checkpoints that cannot be loaded, one-line errors for empty and malformed files, a
full disk, and checkpoints that would run code (crafted DCP `.metadata` and shard entries) refused."""
import builtins
import contextlib
import errno
import glob
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, free_port, load_model_state, make_config, spawn, write_checkpoint

from core import checkpoint
from core.errors import Unloadable

from core import checkpoint_meta
from core import checkpoint_dcp
from core import checkpoint_io
from core import checkpoint_hashes
import main
from resilience import resume
from resilience import run_dir
from core.distributed import DistContext

STEPS = 6
TRAIN = {"max_steps": STEPS, "eval_every": 0, "save_every": 1, "keep_last": 10, "log_every": 1}
FSDP = {"strategy": "fsdp", "procs_per_node": 1}
SINGLE = DistContext(0, 1, 0, torch.device("cpu"), None)


def run(out, train=None, **sections) -> int:
    import torch.distributed as dist
    code = main.run(make_config(out, train={**TRAIN, **(train or {})}, **sections))
    if dist.is_initialized():  # wiring.worker leaves the group up after a failure (peers may be gone); one rank here
        dist.destroy_process_group()
    return code


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def rank_log(out, rank=0) -> str:
    with open(os.path.join(out, "logs", f"rank{rank}.log")) as f:
        return f.read()


def ckpt(out, step) -> str:
    return os.path.join(str(out), "checkpoints", f"step-{step}")


def crashed_copy(reference, out, last):
    """`out` as a run of `reference`'s config killed right after saving step `last`: its checkpoints 1..last."""
    os.makedirs(os.path.join(out, "checkpoints"))
    for step in range(1, last + 1):
        shutil.copytree(ckpt(reference, step), ckpt(out, step))


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference_runs(tmp_path_factory, configs: dict):
    """Uninterrupted runs of STEPS steps, a checkpoint at every step, each made on its first use: `configs` maps a
    name to run()'s sections."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"reference-{name}")
            assert run(out, **configs[name]) == 0
            done[name] = out
        return done[name]
    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_runs(tmp_path_factory, {"none": {"dist": {"strategy": "none"}}, "fsdp": {"dist": FSDP}})


class Payload:
    """Unpickling this runs `touch marker` (pickle stores os.system and its argument, not this class)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


REFUSED = r"refused: it would import (posix|nt|os)\.system \(a checkpoint must never run code\)"


# ---- writing: fsync before the rename, pruning, stale directories ----------------------------------------------
def test_write_fsyncs_every_file_and_directory_before_the_rename(tmp_path, monkeypatch):
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b)))

    def write_files(directory):  # like fsdp: files, and files in a subfolder
        torch.save({"w": torch.ones(3)}, os.path.join(directory, "model.pt"))
        os.makedirs(os.path.join(directory, "model_dcp"))
        with open(os.path.join(directory, "model_dcp", "__0_0.distcp"), "wb") as f:
            f.write(b"shard")

    final = write_checkpoint(str(tmp_path), 7, SINGLE, write_files, {"step": 7, "state": {}})
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 1
    tmp = events[renames[0]][1]
    synced_before = {path for kind, path in events[:renames[0]] if kind == "fsync"}
    for name in ("model.pt", "model_dcp/__0_0.distcp", "meta.json", "model_dcp", ""):
        assert os.path.normpath(os.path.join(tmp, name)) in synced_before, name
    assert ("fsync", os.path.join(str(tmp_path), "checkpoints")) in events[renames[0]:]  # the rename itself
    assert checkpoint.is_complete(final) and checkpoint_meta.read(final)["step"] == 7


def test_a_step_saved_again_survives_a_kill_between_its_two_renames(tmp_path, monkeypatch):
    """A stop right after a resume saves the same step again: the old step-7 moves aside, the new one takes its
    name. Killed between the two renames, the next run puts the old one back; the new one is on disk before."""
    def write(value):
        return write_checkpoint(str(tmp_path), 7, SINGLE, lambda d: torch.save({"w": torch.full((3,), value)},
                                                                               os.path.join(d, "model.pt")),
                                {"step": 7, "state": {}})
    final = write(1.0)
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))

    def rename(a, b):
        events.append(("rename", str(a)))
        if len([e for e in events if e[0] == "rename"]) == 2:
            raise SystemExit("killed")  # the new folder is not yet step-7
        real_rename(a, b)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SystemExit):
        write(2.0)
    monkeypatch.undo()
    first_rename = next(i for i, (kind, _) in enumerate(events) if kind == "rename")
    assert events[first_rename][1] == final  # the old one moved aside...
    new = events[first_rename + 1][1]
    synced_before = {path for kind, path in events[:first_rename] if kind == "fsync"}
    assert {os.path.join(new, "model.pt"), os.path.join(new, "meta.json"), new} <= synced_before  # ...once the new is
    assert not os.path.exists(final) and checkpoint.complete_checkpoints(str(tmp_path)) == []
    assert run_dir.restore_replaced(str(tmp_path)) == [final]
    assert run_dir.clean_stale(str(tmp_path)) == [new]
    assert os.listdir(tmp_path / "checkpoints") == ["step-7"] and checkpoint.is_complete(final)
    assert torch.load(os.path.join(final, "model.pt"))["w"].tolist() == [1.0] * 3
    write(3.0)  # and a save that is not interrupted replaces it
    assert os.listdir(tmp_path / "checkpoints") == ["step-7"]
    assert torch.load(os.path.join(final, "model.pt"))["w"].tolist() == [3.0] * 3


def test_a_stray_file_where_a_step_is_saved_is_replaced_without_a_traceback(tmp_path):
    """A file (not a folder) named step-7 in checkpoints/: saving step 7 moved it aside, then failed deleting it
    with shutil.rmtree's NotADirectoryError (a traceback, exit 1), leaving it there as a .tmp-step-7-replaced-*."""
    os.makedirs(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "step-7").write_text("not a checkpoint")
    final = write_checkpoint(str(tmp_path), 7, SINGLE, lambda d: torch.save({"w": torch.ones(3)},
                                                                            os.path.join(d, "model.pt")),
                             {"step": 7, "state": {}})
    assert os.listdir(tmp_path / "checkpoints") == ["step-7"] and checkpoint.is_complete(final)


def test_a_file_where_the_checkpoints_folder_goes_is_one_line_before_training(tmp_path, capsys):
    """output_dir/checkpoints a file (or a link to one): the first save, after the training before it, ended in a
    traceback (NotADirectoryError, exit 1). Refused at the start in one line naming it."""
    (tmp_path / "checkpoints").write_text("notes")
    assert run(tmp_path) == 2
    assert errors(capsys) == [f"error: {tmp_path}/checkpoints: not a folder (this run saves its checkpoints there): "
                              "move it away, or use another output_dir"]
    assert "step 1/" not in rank_log(tmp_path)


def test_a_file_or_dangling_link_where_the_logs_folder_goes_is_one_line_before_any_rank(tmp_path, capsys):
    """output_dir/logs a file (or a link to nowhere): every rank failed making its log file, a traceback headed
    `rank 0 failed before training (setup): FileExistsError` (exit 1). Refused in one line naming it."""
    for i, make in enumerate([lambda logs: logs.write_text("notes"), lambda logs: logs.symlink_to(tmp_path / "gone")]):
        out = tmp_path / f"run{i}"
        out.mkdir()
        make(out / "logs")
        assert run(out) == 2
        said = capsys.readouterr()
        assert said.err.splitlines() == [f"error: {out}/logs: not a folder (each rank writes its log there): move "
                                         "it away, or use another output_dir"], said.err
        assert not (out / "checkpoints").exists()


def test_prune_makes_a_checkpoint_incomplete_before_deleting_it(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        write_checkpoint(str(tmp_path), step, SINGLE, lambda d: torch.save({}, os.path.join(d, "model.pt")),
                         {"step": step, "state": {}})
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    def killed(path, **kwargs):  # the process dies as pruning starts to delete the files
        assert not os.path.exists(os.path.join(path, "meta.json")) and path in synced
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        checkpoint.prune(str(tmp_path), keep_last=1, keep=set())
    monkeypatch.undo()
    # What the kill left: step-1 still holds model.pt but no longer looks complete, so resume never picks it...
    assert os.path.isfile(os.path.join(ckpt(tmp_path, 1), "model.pt"))
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [2, 3]
    # ...and the next run removes it.
    assert run_dir.clean_stale(str(tmp_path)) == [ckpt(tmp_path, 1)]
    checkpoint.prune(str(tmp_path), keep_last=1, keep=set())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-3"]


def test_a_step_name_with_leading_zeros_or_other_digits_is_not_a_checkpoint(tmp_path):
    """step-04 (a copy made by hand, say) counted as step 4 beside step-4: pruning deleted it, and latest() took
    either. Names of ours are step-N as the run writes them; any other is foreign, left alone."""
    foreign = ["step-004", "step-04", "step-\u0664"]  # (U+0664: an Arabic-Indic 4, which \d matches)
    for name in ["step-3", "step-4"] + foreign:
        os.makedirs(tmp_path / "checkpoints" / name)
        (tmp_path / "checkpoints" / name / "meta.json").write_text("{}")
    assert checkpoint.complete_checkpoints(str(tmp_path)) == [(3, ckpt(tmp_path, 3)), (4, ckpt(tmp_path, 4))]
    checkpoint.prune(str(tmp_path), keep_last=1, keep=set())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted(["step-4"] + foreign)
    for name in foreign:  # nor is one without meta.json taken for an interrupted prune's
        os.remove(tmp_path / "checkpoints" / name / "meta.json")
    assert run_dir.clean_stale(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted(["step-4"] + foreign)


def test_stale_directories_are_removed_at_start_and_logged(reference, tmp_path):
    crashed_copy(reference("none"), tmp_path, 4)
    tmp = tmp_path / "checkpoints" / ".tmp-step-5-0a1b2c3d"  # a save killed halfway
    os.makedirs(tmp)
    (tmp / "model.pt").write_bytes(b"half")
    os.remove(os.path.join(ckpt(tmp_path, 2), "meta.json"))  # a prune killed halfway
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    for path in (str(tmp), ckpt(tmp_path, 2)):
        assert f"removed {path}: left by an interrupted save or prune" in log
    assert not tmp.exists() and not os.path.exists(ckpt(tmp_path, 2))
    assert f"resumed from {ckpt(tmp_path, 4)}" in log
    assert same_params(load_model_state(tmp_path, STEPS), load_model_state(reference("none"), STEPS))


# ---- resume=auto falls back to the newest checkpoint that loads --------------------------------------------------
def empty(name):
    return lambda path: open(os.path.join(path, name), "wb").close()


def write_text(name, text):
    def corrupt(path):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return corrupt


def truncate(name):
    def corrupt(path):
        full = os.path.join(path, name)
        data = open(full, "rb").read()
        open(full, "wb").write(data[: len(data) // 2])
    return corrupt


def drop_key(key):
    def corrupt(path):
        meta = json.load(open(os.path.join(path, "meta.json")))
        del meta[key]
        write_text("meta.json", json.dumps(meta))(path)
    return corrupt


CORRUPTIONS = {  # name: (how, what the one-line message says after the checkpoint's path)
    "model.pt 0 bytes": (empty("model.pt"), "/model.pt: empty (0 bytes)"),
    "optimizer.pt 0 bytes": (empty("optimizer.pt"), "/optimizer.pt: empty (0 bytes)"),  # after model.pt loaded
    "state.pt 0 bytes": (empty("state.pt"), "/state.pt: empty (0 bytes)"),
    "model.pt truncated": (truncate("model.pt"), "/model.pt: truncated ("),
    "meta.json {}": (write_text("meta.json", "{}"), "/meta.json: unreadable (`step` is missing)"),
    "meta.json without state": (drop_key("state"), "/meta.json: unreadable (`state` is missing)"),
    "meta.json not JSON": (write_text("meta.json", '{"step": 4,'), "/meta.json: unreadable ("),
    "meta.json a list": (write_text("meta.json", "[]"), "/meta.json: unreadable (a JSON list, not an object)"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_auto_skips_a_checkpoint_that_cannot_be_loaded(reference, tmp_path, corruption):
    """The newest checkpoint is broken: the run warns, resumes from the one before, and ends exactly where the
    uninterrupted run ended (model, optimizer, scheduler, RNG, data position all restored from step-3, even
    where step-4's model had already been loaded before its optimizer.pt failed)."""
    ref = reference("none")
    crashed_copy(ref, tmp_path, 4)
    how, says = CORRUPTIONS[corruption]
    how(ckpt(tmp_path, 4))
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    assert f"resume: skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {ckpt(tmp_path, 4)}{says}" in log
    assert f"resumed from {ckpt(tmp_path, 3)} at step 3" in log
    assert same_params(load_model_state(tmp_path, STEPS), load_model_state(ref, STEPS))
    a = torch.load(os.path.join(ckpt(tmp_path, STEPS), "optimizer.pt"), weights_only=True)["state"]
    b = torch.load(os.path.join(ckpt(ref, STEPS), "optimizer.pt"), weights_only=True)["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in b)
    # The broken one is kept aside for a look, and step 4 was saved again in its place.
    assert os.path.isdir(ckpt(tmp_path, 4) + ".unloadable")
    assert same_params(load_model_state(tmp_path, 4), load_model_state(ref, 4))


def test_resume_auto_skips_several(reference, tmp_path):
    ref = reference("none")
    crashed_copy(ref, tmp_path, 4)
    empty("optimizer.pt")(ckpt(tmp_path, 4))
    write_text("meta.json", "{}")(ckpt(tmp_path, 3))
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    assert f"skipping {ckpt(tmp_path, 4)}" in log and f"skipping {ckpt(tmp_path, 3)}" in log
    assert f"resumed from {ckpt(tmp_path, 2)} at step 2" in log
    assert same_params(load_model_state(tmp_path, STEPS), load_model_state(ref, STEPS))


def test_no_checkpoint_loads_is_a_one_line_error(reference, tmp_path, capsys):
    crashed_copy(reference("none"), tmp_path, 2)
    empty("model.pt")(ckpt(tmp_path, 1))
    empty("state.pt")(ckpt(tmp_path, 2))
    assert run(tmp_path) == 2
    err = errors(capsys)
    assert err == [f"error: {ckpt(tmp_path, 2)}/state.pt: empty (0 bytes); no older checkpoint loads either (to "
                   "start over, set train.start_over: true or use another output_dir)"]
    assert f"skipping {ckpt(tmp_path, 1)}, which cannot be loaded: {ckpt(tmp_path, 1)}/model.pt: empty" in \
        rank_log(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-1", "step-2"]  # nothing moved or deleted


def failing(full, error=errno.EIO, nth=1):
    """builtins.open, but the `nth` open of file `full` (and each later one) fails with OSError `error` (what no
    permission or a failing disk gives: as root, chmod 000 would not stop us)."""
    real_open, seen = builtins.open, [0]

    def fails(file, *args, **kwargs):
        if str(file) == full:
            seen[0] += 1
            if seen[0] >= nth:
                raise OSError(error, os.strerror(error), full)
        return real_open(file, *args, **kwargs)
    return fails


def test_a_checkpoint_the_machine_cannot_read_is_not_set_aside(reference, tmp_path, capsys, monkeypatch):
    """No permission or a failing disk says nothing of a checkpoint's bytes: resume: auto stops in one line naming
    the file, and sets nothing aside (it did: step-4.unloadable, and the run went back to step-3)."""
    crashed_copy(reference("none"), tmp_path, 4)
    cases = [("model.pt", errno.EACCES, 1),  # its hash, before anything loads
             ("meta.json", errno.EIO, 1),
             ("optimizer.pt", errno.EIO, 2)]  # torch.load, once its hash was read
    for name, error, nth in cases:
        full = os.path.join(ckpt(tmp_path, 4), name)
        monkeypatch.setattr(builtins, "open", failing(full, error, nth))
        assert run(tmp_path) == 2, name
        monkeypatch.undo()
        assert errors(capsys) == [f"error: {full}: cannot be read ({os.strerror(error)}): the disk or the "
                                  "permissions, not the checkpoint's content; fix that and run the same command "
                                  "again (nothing was set aside)"], name
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step-{s}" for s in (1, 2, 3, 4)], name
        assert "skipping" not in rank_log(tmp_path)
    assert run(tmp_path) == 0  # readable again: the same command goes on from step-4
    assert f"resumed from {ckpt(tmp_path, 4)} at step 4" in rank_log(tmp_path)


def test_explicit_resume_path_never_falls_back(reference, tmp_path, capsys):
    crashed_copy(reference("none"), tmp_path, 4)
    empty("model.pt")(ckpt(tmp_path, 4))
    assert run(tmp_path, train={"resume": ckpt(tmp_path, 4)}) == 2
    assert errors(capsys) == [f"error: {ckpt(tmp_path, 4)}/model.pt: empty (0 bytes)"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step-{s}" for s in (1, 2, 3, 4)]


def test_a_checkpoint_that_does_not_fit_is_not_skipped(reference, tmp_path, capsys):
    """A changed model setting is the user's to fix: an older checkpoint of the same run would not fit either."""
    crashed_copy(reference("none"), tmp_path, 4)
    assert run(tmp_path, model={"hidden": 64}) == 2
    err = errors(capsys)
    assert len(err) == 1 and f"{ckpt(tmp_path, 4)}: does not fit this model" in err[0]
    assert "model.hidden=128 (now 64)" in err[0] and "skipping" not in rank_log(tmp_path)


@pytest.mark.parametrize("corruption", ["meta.json {}", "meta.json without state", "meta.json not JSON",
                                        "model.pt 0 bytes"])
def test_broken_files_are_one_line_errors_in_test_mode(reference, tmp_path, capsys, corruption):
    crashed_copy(reference("none"), tmp_path, 2)
    how, says = CORRUPTIONS[corruption]
    how(ckpt(tmp_path, 2))
    assert main.run(make_config(tmp_path, mode="test")) == 2  # test mode picks the best of the latest's meta.json
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt(tmp_path, 2)}{says}"), err


def test_empty_meta_json_with_a_model_that_does_not_fit(reference, tmp_path, capsys):
    """The does-not-fit message reads meta.json to name the changed settings; a `{}` one must not break it (loaded
    on purpose: an unreadable meta.json is otherwise refused before any weight is read)."""
    crashed_copy(reference("none"), tmp_path, 1)
    write_text("meta.json", "{}")(ckpt(tmp_path, 1))
    cfg = make_config(tmp_path, mode="test", model={"hidden": 64}, test={"checkpoint": ckpt(tmp_path, 1)},
                      allow_unverified=True)
    assert main.run(cfg) == 2
    err = errors(capsys)
    assert len(err) == 1 and f"{ckpt(tmp_path, 1)}: does not fit this model: size mismatch" in err[0], err


# ---- a full disk -------------------------------------------------------------------------------------------------
def full_disk_at(monkeypatch, step, how):
    """torch.save fails as on a full disk while writing optimizer.pt of checkpoint `step` (model.pt is written)."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if f".tmp-step-{step}-" in str(path) and str(path).endswith("optimizer.pt"):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)  # what fit
            if how == "errno":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            # torch.save's own words on a full disk (no errno); the free space tells
            monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255)))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 283776 vs 283728")
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("how", ["errno", "torch.save's RuntimeError"])
def test_full_disk_is_one_line_and_the_previous_checkpoint_resumes(reference, tmp_path, capsys, monkeypatch, how):
    full_disk_at(monkeypatch, 3, how)
    assert run(tmp_path) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: no space left on device writing {ckpt(tmp_path, 3)} ("), err
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-1", "step-2"]  # the temporary directory is gone
    monkeypatch.undo()
    assert run(tmp_path) == 0  # space freed: the same command resumes from step-2
    assert f"resumed from {ckpt(tmp_path, 2)}" in rank_log(tmp_path)
    assert same_params(load_model_state(tmp_path, STEPS), load_model_state(reference("none"), STEPS))


def test_an_error_that_is_not_a_full_disk_is_not_called_one(tmp_path):
    def write_files(directory):
        raise OSError(errno.EACCES, "Permission denied")
    with pytest.raises(OSError, match="Permission denied"):
        write_checkpoint(str(tmp_path), 1, SINGLE, write_files, {"step": 1, "state": {}})


def open_files_in(folder) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
                found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


@pytest.mark.parametrize("strategy", ["none", "fsdp"])
def test_full_disk_on_a_real_small_filesystem(reference, tmp_path, capsys, strategy):
    """checkpoints/ on a tmpfs that holds one checkpoint and a half: step-2 does not fit. (Needs root.)"""
    ref = reference(strategy)
    one = sum(os.path.getsize(f) for f in glob.glob(os.path.join(ckpt(ref, 1), "**"), recursive=True)
              if os.path.isfile(f))
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    size_kb = one * 3 // 2 // 1024
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip() or mount.returncode}")
    try:
        dist = FSDP if strategy == "fsdp" else {"strategy": "none"}
        assert run(tmp_path, train={"keep_last": 1}, dist=dist) == 2
        err = errors(capsys)
        assert len(err) == 1 and err[0].startswith(f"error: no space left on device writing {ckpt(tmp_path, 2)} ("), \
            err
        assert os.listdir(folder) == ["step-1"]
        assert not open_files_in(folder)  # what the failed write took is free again, not held by an open file
        subprocess.run(["mount", "-o", f"remount,size={size_kb * 4}k", str(folder)], check=True)
        assert run(tmp_path, train={"keep_last": 1}, dist=dist) == 0
        assert f"resumed from {ckpt(tmp_path, 1)}" in rank_log(tmp_path)
        resumed, uninterrupted = (checkpoint_io.model_state_dict(ckpt(d, STEPS)) for d in (tmp_path, ref))
        assert same_params(resumed, uninterrupted)
    finally:
        if subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)])  # detach it anyway; the test has failed



# ---- loading never runs code: fsdp (DCP) checkpoints ---------------------------------------------------------
def craft_metadata(path, folder, marker):
    with open(os.path.join(path, folder, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    rehash(path)


def rehash(path):
    """meta.json's record of the files made to match them, as the maker of a crafted checkpoint would: what then
    refuses it are the checks behind the hashes."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    write_text("meta.json", json.dumps({**meta, "files": checkpoint_hashes.record(path)}))(path)


@pytest.mark.parametrize("folder", ["model_dcp", "optimizer_dcp"])
def test_crafted_dcp_metadata_is_refused_on_resume(reference, tmp_path, capsys, folder):
    crashed_copy(reference("fsdp"), tmp_path, 4)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt(tmp_path, 4), folder, marker)
    assert run(tmp_path, train={"resume": ckpt(tmp_path, 4)}, dist=FSDP) == 2  # an explicit path: an error
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt(tmp_path, 4)}/{folder}/.metadata: refused"), err
    assert re.search(REFUSED, err[0])
    assert not marker.exists()
    assert run(tmp_path, dist=FSDP) == 0  # auto: skips it, resumes from step-3, ends as the uninterrupted run
    log = rank_log(tmp_path)
    assert f"skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {ckpt(tmp_path, 4)}/{folder}/.metadata: " \
           "refused: it would import" in log
    assert f"resumed from {ckpt(tmp_path, 3)} at step 3" in log
    assert not marker.exists()
    assert same_params(checkpoint_io.model_state_dict(ckpt(tmp_path, STEPS)),
                       checkpoint_io.model_state_dict(ckpt(reference("fsdp"), STEPS)))


def test_crafted_dcp_metadata_is_refused_in_test_mode(reference, tmp_path, capsys):
    crashed_copy(reference("fsdp"), tmp_path, 2)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt(tmp_path, 2), "model_dcp", marker)
    assert main.run(make_config(tmp_path, mode="test", dist=FSDP)) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt(tmp_path, 2)}/model_dcp/.metadata: refused"), err
    assert re.search(REFUSED, err[0])
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "dev_results.json")


def test_dcp_entries_are_read_once_by_the_weights_only_loader(reference, monkeypatch):
    """Issue 40, item 9: DCP's planner read each entry's bytes again with weights_only=False after our check."""
    folder, calls, real = os.path.join(ckpt(reference("fsdp"), STEPS), "optimizer_dcp"), [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(kwargs.get("weights_only")) or
                        real(*args, **kwargs))
    state = checkpoint_dcp.dcp_model_state_dict(folder)
    assert state["param_groups"] and calls and set(calls) == {True}, calls  # (lr, betas, ...: not tensors)


def test_crafted_entry_inside_dcp_shards_is_refused(reference, tmp_path, capsys):
    """DCP unpickles entries that are not tensors (the optimizer's lr, ...) with torch.load(weights_only=False)."""
    import torch.distributed.checkpoint as dcp
    crashed_copy(reference("fsdp"), tmp_path, 2)
    marker = tmp_path / "pwned"
    # An extra model entry; a replaced step count in the optimizer's state. (Its param_groups are never read on
    # resume: the run's own groups stay, so a crafted lr there is not even unpickled.)
    for step, folder in ((1, "model_dcp"), (2, "optimizer_dcp")):
        path = os.path.join(ckpt(tmp_path, step), folder)
        state = checkpoint_dcp.dcp_model_state_dict(path)
        if folder == "model_dcp":
            state["extra"] = Payload(marker)
        else:
            first = sorted(state["state"])[0]
            state["state"][first]["step"] = Payload(marker)
        shutil.rmtree(path)
        with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=path, no_dist=True)
        rehash(ckpt(tmp_path, step))
    cfg = make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 1)})
    assert main.run(cfg) == 2
    assert run(tmp_path, train={"resume": ckpt(tmp_path, 2)}, dist=FSDP) == 2
    err = errors(capsys)
    assert len(err) == 2 and not marker.exists(), err
    assert err[0].startswith(f"error: {ckpt(tmp_path, 1)}/model_dcp: entry extra: refused: it would import")
    assert err[1].startswith(f"error: {ckpt(tmp_path, 2)}/optimizer_dcp: entry state.{first}.step: refused: it would")


@pytest.mark.parametrize("damage", ["shard truncated", "shard missing", ".metadata empty"])
def test_damaged_dcp_folder_is_a_one_line_error_naming_the_file(reference, tmp_path, capsys, damage):
    crashed_copy(reference("fsdp"), tmp_path, 2)
    folder = os.path.join(ckpt(tmp_path, 2), "optimizer_dcp")
    if damage == "shard truncated":
        truncate("__0_0.distcp")(folder)
        says = f"{folder}/__0_0.distcp: truncated ("
    elif damage == "shard missing":
        os.remove(os.path.join(folder, "__0_0.distcp"))
        says = f"{folder}/__0_0.distcp: missing from the checkpoint"
    else:
        empty(".metadata")(folder)
        says = f"{folder}/.metadata: empty (0 bytes)"
    assert run(tmp_path, train={"resume": ckpt(tmp_path, 2)}, dist=FSDP) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {says}"), err


def test_a_real_fsdp_checkpoint_still_loads_in_test_mode(reference, tmp_path):
    """The checks accept everything DCP writes (resume from a real one is checked above: it ends bit-exact)."""
    from torch.distributed.checkpoint.metadata import Metadata
    ref = reference("fsdp")
    for folder in ("model_dcp", "optimizer_dcp"):
        assert isinstance(checkpoint_dcp.read_dcp_metadata(os.path.join(ckpt(ref, STEPS), folder)), Metadata)
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(ref, STEPS)})) == 0
    dev = json.load(open(tmp_path / "dev_results.json"))
    trained = checkpoint_meta.read(ckpt(ref, STEPS))["metrics"]  # dev metrics of the training run, at its end
    assert dev["metrics"]["samples"] == trained["samples"] == 225
    assert dev["metrics"]["accuracy"] == pytest.approx(trained["accuracy"])


# ---- ranks agree on the checkpoint they resume from -------------------------------------------------------------
def _agree_worker(rank, port, out, result_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
    loaded = []

    def load(path):  # step-3 fails on rank 1 only: then rank 0 must not resume from it either
        if path.endswith("step-3") and rank == 1:
            raise Unloadable(f"{path}/model.pt: empty (0 bytes)")
        loaded.append(path)

    warnings = []
    path = resume.load_newest(out, ctx, load, warnings.append)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"path": path, "loaded": loaded, "warnings": warnings}, f)
    dist.destroy_process_group()


def test_ranks_fall_back_together(tmp_path):
    from conftest import free_port
    for step in (1, 2, 3):
        write_checkpoint(str(tmp_path), step, SINGLE, lambda d: None, {"step": step, "state": {}})
    spawn(_agree_worker, args=(free_port(), str(tmp_path), str(tmp_path)), nprocs=2)
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert [r["path"] for r in results] == [ckpt(tmp_path, 2)] * 2
    assert results[0]["loaded"] == [ckpt(tmp_path, 3), ckpt(tmp_path, 2)]  # rank 0 loaded step-3, then step-2
    assert all(f"skipping {ckpt(tmp_path, 3)}, which cannot be loaded: {ckpt(tmp_path, 3)}/model.pt: empty" in
               r["warnings"][0] for r in results)
    assert os.path.isdir(ckpt(tmp_path, 3) + ".unloadable")  # moved aside once (by rank 0)


def _unreadable_worker(rank, port, out, result_dir):
    import datetime
    import types
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))  # (a rank left waiting fails, not hangs)
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
    if rank == 0:  # the newest meta.json, read by rank 0 only in both
        pytest.MonkeyPatch().setattr(builtins, "open", failing(os.path.join(ckpt(out, 2), "meta.json")))
    trainer = types.SimpleNamespace(ctx=ctx, cfg=types.SimpleNamespace(output_dir=out), log=None)
    said = []
    for check in (lambda: resume.explicit_or_newer(trainer, ckpt(out, 1)),
                  lambda: checkpoint_io.verify(ckpt(out, 2), ctx)):
        try:
            check()
        except Unloadable as e:
            said.append(f"unloadable: {e}")
        except checkpoint_io.CheckpointError as e:
            said.append(str(e))
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(said, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_file_rank_0_cannot_read_stops_every_rank_in_one_line(tmp_path):
    """Rank 0 alone reads the newest checkpoint's meta.json (train.resume: PATH's check, the hash check): one it
    cannot read left the other rank waiting for its answer."""
    from conftest import free_port
    for step in (1, 2):
        write_checkpoint(str(tmp_path), step, SINGLE, lambda d: None, {"step": step, "state": {}})
    spawn(_unreadable_worker, args=(free_port(), str(tmp_path), str(tmp_path)), nprocs=2)
    line = f"{ckpt(tmp_path, 2)}/meta.json: cannot be read (Input/output error): the disk or the permissions, " \
           "not the checkpoint's content; fix that and run the same command again (nothing was set aside)"
    assert [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)] == [[line, line]] * 2


@pytest.mark.slow
def test_two_fsdp_ranks_fall_back_past_a_crafted_checkpoint_together(tmp_path):
    """2 ranks, fsdp: step-4's optimizer_dcp/.metadata is crafted, so its model_dcp has already been loaded into
    the (sharded) parameters when the refusal comes; both ranks go back to step-3 and end bit-exact."""
    two = {"dist": {"strategy": "fsdp", "procs_per_node": 2}, "train": {"batch_size": 16}}
    assert run(tmp_path / "reference", **two) == 0
    out, marker = tmp_path / "out", tmp_path / "pwned"
    crashed_copy(tmp_path / "reference", out, 4)
    craft_metadata(ckpt(out, 4), "optimizer_dcp", marker)
    assert run(out, **two) == 0
    for rank in (0, 1):
        log = rank_log(out, rank)
        assert f"skipping {ckpt(out, 4)}, which cannot be loaded: {ckpt(out, 4)}/optimizer_dcp/.metadata: refused" \
            in log and f"resumed from {ckpt(out, 3)} at step 3" in log
    assert not marker.exists()
    assert same_params(checkpoint_io.model_state_dict(ckpt(out, STEPS)),
                       checkpoint_io.model_state_dict(ckpt(tmp_path / "reference", STEPS)))


def test_a_save_out_of_file_descriptors_is_one_line_naming_the_limit(reference, tmp_path, capsys, monkeypatch):
    """Issue 40, item 8: `prlimit --nofile=32` made a save fail with a 64-line traceback (EMFILE)."""
    import resource
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if ".tmp-step-3-" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", save)
    assert run(tmp_path) == 2
    err = errors(capsys)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert len(err) == 1 and err[0].startswith(f"error: too many open files opening {tmp_path}/checkpoints/"
                                               ".tmp-step-3-"), err
    assert f"optimizer.pt: this process may open {soft} files at once (ulimit -n): raise it (ulimit -n 65536" \
        in err[0]
    for step in (1, 2):  # the checkpoints before it are intact
        checkpoint_io.verify(ckpt(tmp_path, step))


def test_hashing_opens_a_bounded_number_of_files_at_once(tmp_path, monkeypatch):
    for i in range(40):
        (tmp_path / f"shard-{i}").write_bytes(os.urandom(1000))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a large machine: still at most 8 threads, 8 files open
    open_now, most, real_open = [0], [0], open

    class Counted:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])

        def __enter__(self):
            return self.f

        def __exit__(self, *exc):
            open_now[0] -= 1
            self.f.close()
    monkeypatch.setattr(checkpoint_hashes, "open", Counted, raising=False)
    found = checkpoint_hashes.record(str(tmp_path))
    assert len(found) == 40 and 1 <= most[0] <= checkpoint_hashes.MAX_OPEN


@pytest.mark.slow
def test_a_node_with_its_own_copy_reads_only_what_rank_0_verified(tmp_path):
    """Two nodes, each with its own disk (its own working folder; output_dir `run` relative to it): rank 0 verified
    node 0's files and its meta.json, while rank 1 read node 1's meta.json and files unchecked, so a model.pt changed
    there (its hash rewritten in that meta.json) was loaded into rank 1 without a word."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    assert main.run(make_config(nodes[0] / "run", train={"max_steps": 2, "eval_every": 0, "batch_size": 32})) == 0
    shutil.copytree(nodes[0] / "run" / "checkpoints", nodes[1] / "run" / "checkpoints")
    copy = nodes[1] / "run" / "checkpoints" / "step-2"
    data = bytearray((copy / "model.pt").read_bytes())
    data[-100] ^= 1  # a bit of a weight: torch.load reads it without complaint
    (copy / "model.pt").write_bytes(bytes(data))
    meta = json.loads((copy / "meta.json").read_text())
    meta["files"]["model.pt"]["sha256"] = checkpoint_hashes.hash_file(str(copy / "model.pt"))
    (copy / "meta.json").write_text(json.dumps(meta))
    common = ["output_dir=run", "dist.strategy=ddp", "dist.nodes=2", "dist.procs_per_node=1",
              "dist.master_addr=127.0.0.1", f"dist.master_port={free_port()}", "train.batch_size=16",
              "train.max_steps=3", "train.eval_every=0", "log.progress_bar=false", "log.tensorboard=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "main.py"), "--params",
                               os.path.join(ROOT, "parameters.yml"),
                               *(a for s in common + [f"dist.node_rank={n}"] for a in ("--set", s))],
                              cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, node in enumerate(nodes)]
    ends = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert [code for code, _ in ends] == [2, 2], ends
    line = [line for line in ends[0][1].splitlines() if line.startswith("error:")]
    assert len(line) == 1 and "run/checkpoints/step-2/model.pt: sha256 differs from meta.json" in line[0] and \
        "(as rank 1 on " in line[0] and "there is no older checkpoint" in line[0], ends[0][1]
    assert not os.path.exists(nodes[1] / "run" / "checkpoints" / "step-3")
