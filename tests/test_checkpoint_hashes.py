"""Checkpoints that prove their bytes (issue 33, item 1): meta.json records the size and sha256 of every file a
checkpoint writes (whole, DCP shards, async saves), and a file that changed after the save (one flipped byte, which
torch.load and DCP read without complaint) is refused in one line naming it before anything is loaded: resume=auto
falls back to the previous checkpoint, an explicit path, test mode and export stop with exit code 2. A checkpoint
without the record (issue 40) is refused the same way, unless allow_unverified: true (then it loads, said once)."""
import hashlib
import json
import os
import re
import threading

import pytest
import torch

from conftest import make_config
from test_checkpoint_faults import STEPS, ckpt, crashed_copy, errors, rank_log, reference_runs, run, same_params


from core import checkpoint_meta
from core.errors import Unloadable
from core import checkpoint_hashes
from core import checkpoint_io
import main
from wiring import build_task

FSDP2 = {"dist": {"strategy": "fsdp", "procs_per_node": 2}, "train": {"batch_size": 16}}
CHANGED = "sha256 differs from meta.json (the file changed after it was saved)"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_runs(tmp_path_factory, {"none": {}, "fsdp": FSDP2})  # 'fsdp': 2 ranks


def flip_byte(path: str) -> None:
    """One bit flipped in the middle of the file: in the tensors' bytes, past any header."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))


def edit_meta(path: str, change) -> None:
    full = os.path.join(path, "meta.json")
    meta = json.load(open(full))
    change(meta)
    with open(full, "w") as f:
        json.dump(meta, f)


def test_meta_json_records_every_file_with_its_sha256(reference):
    path = ckpt(reference("none"), 4)
    files = checkpoint_meta.read(path)["files"]
    assert sorted(files) == ["model.pt", "optimizer.pt", "state.pt"]
    for name, entry in files.items():
        data = open(os.path.join(path, name), "rb").read()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    checkpoint_io.verify(path)  # as saved: nothing to say


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "state.pt"])
def test_resume_falls_back_past_a_flipped_byte(reference, tmp_path, name):
    ref = reference("none")
    crashed_copy(ref, tmp_path, 4)
    flip_byte(os.path.join(ckpt(tmp_path, 4), name))
    torch.load(os.path.join(ckpt(tmp_path, 4), name), weights_only=True)  # what loaded silently before
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    line = f"resume: skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {ckpt(tmp_path, 4)}/{name}: {CHANGED}"
    assert log.count(line) == 1
    assert f"resumed from {ckpt(tmp_path, 3)} at step 3" in log
    assert os.path.isdir(ckpt(tmp_path, 4) + ".unloadable")  # kept aside for a look; step 4 saved again
    assert same_params(checkpoint_io.model_state_dict(ckpt(tmp_path, STEPS)),
                       checkpoint_io.model_state_dict(ckpt(ref, STEPS)))


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "state.pt"])
def test_explicit_resume_test_mode_and_export_refuse_a_flipped_byte(reference, tmp_path, capsys, name):
    crashed_copy(reference("none"), tmp_path, 4)
    flip_byte(os.path.join(ckpt(tmp_path, 4), name))
    line = f"error: {ckpt(tmp_path, 4)}/{name}: {CHANGED}"
    assert run(tmp_path, train={"resume": ckpt(tmp_path, 4)}) == 2  # an explicit path never falls back
    assert errors(capsys) == [line]
    assert main.run(make_config(tmp_path, mode="test")) == 2  # the best: the latest here
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 4)})) == 2
    assert main.run(make_config(tmp_path, mode="export", export={"dir": str(tmp_path / "export")})) == 2
    assert errors(capsys) == [line] * 3
    assert not (tmp_path / "export").exists() and not (tmp_path / "dev_results.json").exists()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"step-{s}" for s in (1, 2, 3, 4)]  # nothing moved
    with pytest.raises(Unloadable, match=re.escape(CHANGED)):  # generate.py's loading
        checkpoint_io.load_model(torch.nn.Linear(1, 1), ckpt(tmp_path, 4))


@pytest.mark.slow  # 11 s: two fsdp ranks twice (the reference, the fall-back); quick loop: the one-process flips above
def test_two_fsdp_ranks_fall_back_past_a_flipped_shard(reference, tmp_path, capsys):
    """One byte of rank 1's model shard (a .distcp file) flipped in step-4: both ranks go back to step-3 and end
    bit-exact; test mode (one process) refuses step-4."""
    ref = reference("fsdp")
    crashed_copy(ref, tmp_path, 4)
    shard = os.path.join(ckpt(tmp_path, 4), "model_dcp", "__1_0.distcp")
    flip_byte(shard)
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 4)})) == 2
    assert errors(capsys) == [f"error: {shard}: {CHANGED}"]
    assert run(tmp_path, **FSDP2) == 0
    for rank in (0, 1):
        log = rank_log(tmp_path, rank)
        assert f"skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {shard}: {CHANGED}" in log
        assert f"resumed from {ckpt(tmp_path, 3)} at step 3" in log
    assert same_params(checkpoint_io.model_state_dict(ckpt(tmp_path, STEPS)),
                       checkpoint_io.model_state_dict(ckpt(ref, STEPS)))


UNRECORDED = "holds no record of the files (`files`: an older version saved it), so they cannot be verified"
ANYWAY = "; to load it anyway, set allow_unverified: true"


def test_a_checkpoint_without_its_record_is_refused_by_every_reader(reference, tmp_path, capsys):
    """Issue 40, item 1: no meta.json, or one without `files`: nothing of it is read unless allow_unverified."""
    crashed_copy(reference("none"), tmp_path, 4)
    edit_meta(ckpt(tmp_path, 4), lambda meta: meta.pop("files"))
    line = f"{ckpt(tmp_path, 4)}/meta.json: {UNRECORDED}{ANYWAY}"
    assert main.run(make_config(tmp_path, mode="test")) == 2
    assert main.run(make_config(tmp_path, mode="export", export={"dir": str(tmp_path / "export")})) == 2
    assert errors(capsys) == [f"error: {line}"] * 2
    assert not (tmp_path / "export").exists() and not (tmp_path / "dev_results.json").exists()
    with pytest.raises(Unloadable) as caught:  # generate.py's loading
        checkpoint_io.load_model(torch.nn.Linear(1, 1), ckpt(tmp_path, 4))
    assert str(caught.value) == line
    os.remove(os.path.join(ckpt(tmp_path, 3), "meta.json"))  # a folder of weights without its meta.json
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 3)})) == 2
    assert errors(capsys) == [f"error: its files cannot be verified: {ckpt(tmp_path, 3)}: not a complete checkpoint "
                              f"(no meta.json){ANYWAY}"]
    assert run(tmp_path) == 0  # resume: auto falls back past both, to the last verified one, and says so
    log = rank_log(tmp_path)
    assert f"resume: skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {line}" in log
    assert f"resumed from {ckpt(tmp_path, 2)} at step 2" in log


def test_allow_unverified_loads_an_old_checkpoint_saying_so_once(reference, tmp_path, capsys):
    crashed_copy(reference("none"), tmp_path, 4)
    edit_meta(ckpt(tmp_path, 4), lambda meta: meta.pop("files"))
    note = f"loading {ckpt(tmp_path, 4)} unverified (allow_unverified: true): {ckpt(tmp_path, 4)}/meta.json: " \
           f"{UNRECORDED}"
    assert main.run(make_config(tmp_path, mode="test", allow_unverified=True)) == 0
    assert capsys.readouterr().out.count(note) == 1
    before = len(rank_log(tmp_path))  # the log goes on from test mode's
    assert run(tmp_path, allow_unverified=True) == 0
    log = rank_log(tmp_path)[before:]
    assert log.count(note) == 1 and f"resumed from {ckpt(tmp_path, 4)} at step 4" in log
    assert "files" in checkpoint_meta.read(ckpt(tmp_path, STEPS))  # what this run saves carries them
    with open(os.path.join(ckpt(tmp_path, 3), "meta.json"), "w") as f:
        f.write("{")  # unreadable: loaded on purpose too
    capsys.readouterr()
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 3)},
                                allow_unverified=True)) == 0
    assert capsys.readouterr().out.count(f"loading {ckpt(tmp_path, 3)} unverified (allow_unverified: true): its "
                                         f"files cannot be verified: {ckpt(tmp_path, 3)}/meta.json: unreadable") == 1


def test_allow_unverified_loads_an_unreadable_meta_json_beside_a_weight_average(tmp_path, capsys, monkeypatch):
    """allow_unverified loads a checkpoint whose meta.json cannot be read, as docs/checkpoints.md says, in test mode
    and export too where ema.pt is there: test.weights auto and the class names read meta.json again, unchecked,
    and failed on it. Without meta.json nothing says how the best was picked: the trained weights are read."""
    assert run(tmp_path, train={"max_steps": 2, "ema_decay": 0.9}) == 0
    path = ckpt(tmp_path, 2)
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write("{")
    capsys.readouterr()
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": path}, allow_unverified=True)) == 0
    assert json.load(open(tmp_path / "dev_results.json"))["weights"] == "trained"
    assert main.run(make_config(tmp_path, mode="export", test={"checkpoint": path}, allow_unverified=True,
                                export={"dir": str(tmp_path / "export")})) == 0
    assert os.path.isfile(tmp_path / "export" / "model.safetensors")
    captured = capsys.readouterr()
    assert errors(capsys) == [] and "error:" not in captured.err
    assert captured.out.count(f"loading {path} unverified (allow_unverified: true): its files cannot be "
                              f"verified: {path}/meta.json: unreadable") == 1  # test mode's; export's on stderr
    assert captured.err.count(f"loading {path} unverified (allow_unverified: true)") == 1
    # A sound one: load_model reads its meta.json once, the record it verified, for every check (it read it 5 times)
    reads, real = [], checkpoint_meta.read
    monkeypatch.setattr(checkpoint_io, "read_meta", lambda where: reads.append(where) or real(where))
    cfg = make_config(tmp_path)
    task = build_task(cfg)
    task.prepare_inference(None)
    assert checkpoint_io.load_model(task.build_model(), ckpt(tmp_path, 1), cfg, label_names=list("0123456789"),
                                    vocabulary_sha256="0" * 64) == "trained"
    assert reads == [ckpt(tmp_path, 1)]


def test_a_missing_or_an_extra_file_is_refused(reference, tmp_path, capsys):
    crashed_copy(reference("none"), tmp_path, 4)
    os.remove(os.path.join(ckpt(tmp_path, 4), "state.pt"))
    with pytest.raises(Unloadable) as caught:
        checkpoint_io.verify(ckpt(tmp_path, 4))
    assert str(caught.value) == f"{ckpt(tmp_path, 4)}/state.pt: missing from the checkpoint (meta.json lists it)"
    # A file the save did not write would be read unverified (model.pt is read before model_dcp/, say).
    os.makedirs(os.path.join(ckpt(tmp_path, 3), "model_dcp"))
    open(os.path.join(ckpt(tmp_path, 3), "model_dcp", "__0_0.distcp"), "wb").close()
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 3)})) == 2
    assert errors(capsys) == [f"error: {ckpt(tmp_path, 3)}/model_dcp/__0_0.distcp: not in meta.json's list of "
                              "files (added after the checkpoint was saved; remove it)"]


def test_a_fifo_in_a_checkpoint_is_refused_without_opening_it(tmp_path):
    """A FIFO (a tar archive can hold one) listed in a crafted record as an empty file: hashing it opened it and
    waited forever for a writer; so did reading a meta.json that is one. Refused in one line naming it, as a
    symlink is, before anything is opened."""
    os.mkfifo(tmp_path / "model.pt")
    empty = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    found = []
    worker = threading.Thread(target=lambda: found.append(checkpoint_hashes.problem(str(tmp_path), {"model.pt": empty})),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert found == [f"{tmp_path}/model.pt: not a regular file (a FIFO, socket or device: refused, never opened; a "
                     "checkpoint holds its own files only)"]
    # meta.json itself, read before the files are checked (test.checkpoint, resume's state): a FIFO, or a link to one
    for name, make in (("fifo", os.mkfifo), ("link", lambda path: os.symlink(tmp_path / "model.pt", path))):
        os.makedirs(tmp_path / name)
        make(tmp_path / name / "meta.json")
        found.clear()

        def read(where=str(tmp_path / name)):
            with pytest.raises(Unloadable) as caught:
                checkpoint_meta.read(where)
            found.append(str(caught.value))
        worker = threading.Thread(target=read, daemon=True)
        worker.start()
        worker.join(10)
        assert found == [f"{tmp_path}/{name}/meta.json: unreadable (not a regular file: a symlink, FIFO, socket or "
                         "device; a checkpoint holds its own files only)"]


BAD_RECORDS = {  # name: (files, what the line says after `.../meta.json: unreadable (`files` `)
    "a list": ([], "is a list, not an object"),
    "a path outside": ({"../../step-3/model.pt": None}, "names '../../step-3/model.pt', not a file inside"),
    "an absolute path": ({"/etc/passwd": None}, "names '/etc/passwd', not a file inside"),
    "meta.json itself": ({"meta.json": None}, "names 'meta.json', not a file inside"),
    "no sha256": ({"model.pt": {"bytes": 1}}, "entry 'model.pt' is {'bytes': 1}, not"),
    "a short sha256": ({"model.pt": {"bytes": 1, "sha256": "ab"}}, "entry 'model.pt' is"),
    "bytes a bool": ({"model.pt": {"bytes": True, "sha256": "0" * 64}}, "entry 'model.pt' is"),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_malformed_record_is_refused_in_one_line(reference, tmp_path, name):
    files, says = BAD_RECORDS[name]
    crashed_copy(reference("none"), tmp_path, 4)
    edit_meta(ckpt(tmp_path, 4), lambda meta: meta.update(files=files))
    with pytest.raises(Unloadable) as caught:
        checkpoint_io.verify(ckpt(tmp_path, 4))
    message = str(caught.value)
    assert message.startswith(f"{ckpt(tmp_path, 4)}/meta.json: unreadable (`files` {says}"), message
    assert "\n" not in message and len(message) < 300


def test_each_file_is_hashed_once_per_load_and_a_short_one_not_at_all(reference, tmp_path, monkeypatch):
    crashed_copy(reference("none"), tmp_path, 4)
    hashed, real = [], checkpoint_hashes.hash_file
    monkeypatch.setattr(checkpoint_hashes, "hash_file", lambda path: hashed.append(path) or real(path))
    assert run(tmp_path) == 0
    read = sorted(os.path.relpath(p, ckpt(tmp_path, 4)) for p in hashed if p.startswith(ckpt(tmp_path, 4) + "/"))
    assert read == ["model.pt", "optimizer.pt", "state.pt"]  # resume read step-4 once, not once per file read
    hashed.clear()
    with open(os.path.join(ckpt(tmp_path, 3), "optimizer.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(Unloadable, match=r"optimizer.pt: truncated \(100 of \d+ bytes\)"):
        checkpoint_io.verify(ckpt(tmp_path, 3))
    assert hashed == []  # sizes first: a truncated file is said without reading a byte


def test_async_save_checkpoints_carry_the_record(tmp_path):
    cfg = make_config(tmp_path, train={"max_steps": 4, "epochs": 0, "save_every": 2, "eval_every": 0,
                                       "keep_last": 5, "async_save": True})
    assert main.run(cfg) == 0
    for step in (2, 4):
        path = ckpt(tmp_path, step)
        assert checkpoint_meta.read(path)["files"] == checkpoint_hashes.record(path)
        assert sorted(checkpoint_meta.read(path)["files"]) == ["model.pt", "optimizer.pt", "state.pt"]


@pytest.mark.slow
def test_fsdp_dcp_async_save_checkpoints_carry_the_record(tmp_path):
    """2 ranks, DCP's async_save: every rank's shards are in the record, written while training went on."""
    cfg = make_config(tmp_path, train={"max_steps": 4, "epochs": 0, "save_every": 2, "eval_every": 0,
                                       "keep_last": 5, "batch_size": 16, "async_save": True},
                      dist=FSDP2["dist"])
    assert main.run(cfg) == 0
    for step in (2, 4):
        path = ckpt(tmp_path, step)
        files = checkpoint_meta.read(path)["files"]
        assert files == checkpoint_hashes.record(path)
        assert {"model_dcp/__0_0.distcp", "model_dcp/__1_0.distcp", "optimizer_dcp/__1_0.distcp"} <= set(files)
    flip_byte(os.path.join(ckpt(tmp_path, 4), "optimizer_dcp", "__0_0.distcp"))
    with pytest.raises(Unloadable, match=re.escape(CHANGED)):
        checkpoint_io.verify(ckpt(tmp_path, 4))


def test_a_symlink_anywhere_in_a_checkpoint_refuses_it(reference, tmp_path, capsys):
    """Issue 40, item 3: os.walk does not follow a linked folder, so an `optimizer_dcp` link passed the file rule and
    was loaded (load_whole prefers optimizer_dcp/) unverified. Now any link, at any depth, refuses the checkpoint."""
    crashed_copy(reference("none"), tmp_path, 4)
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere / "optimizer_dcp")
    os.symlink(elsewhere / "optimizer_dcp", os.path.join(ckpt(tmp_path, 4), "optimizer_dcp"))
    os.makedirs(os.path.join(ckpt(tmp_path, 3), "deep", "er"))
    link = os.path.join(ckpt(tmp_path, 3), "deep", "er", "model.pt")
    os.symlink(os.path.join(ckpt(tmp_path, 3), "model.pt"), link)
    says = "a symlink inside the checkpoint (refused: it is never followed; a checkpoint holds its own files only)"
    assert main.run(make_config(tmp_path, mode="test", test={"checkpoint": ckpt(tmp_path, 3)},
                                allow_unverified=True)) == 2
    assert errors(capsys) == [f"error: {link}: {says}"]
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    assert f"skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {ckpt(tmp_path, 4)}/optimizer_dcp: {says}" in log
    assert f"skipping {ckpt(tmp_path, 3)}, which cannot be loaded: {link}: {says}" in log
    assert f"resumed from {ckpt(tmp_path, 2)} at step 2" in log
    assert os.listdir(elsewhere / "optimizer_dcp") == []  # nothing read or written through the link


# ---- signed checkpoints (issue 40, item 2) -------------------------------------------------------------------
def test_signed_checkpoints_catch_a_weight_rewritten_with_its_hash(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CHECKPOINT_SIGNING_KEY", "a secret for the test")
    assert run(tmp_path, train={"max_steps": 2}) == 0
    assert "checkpoints: signed with HMAC-SHA256 (key from CHECKPOINT_SIGNING_KEY)" in rank_log(tmp_path)
    path = ckpt(tmp_path, 2)
    checkpoint_io.verify(path)  # as saved
    # The tamperer changes a weight and writes its new size and sha256 into meta.json: the hashes agree.
    flip_byte(os.path.join(path, "model.pt"))
    data = open(os.path.join(path, "model.pt"), "rb").read()
    edit_meta(path, lambda meta: meta["files"].update({"model.pt": {"bytes": len(data),
                                                                    "sha256": hashlib.sha256(data).hexdigest()}}))
    monkeypatch.delenv("CHECKPOINT_SIGNING_KEY")
    checkpoint_io.verify(path)  # without the key, the hashes alone cannot tell
    monkeypatch.setenv("CHECKPOINT_SIGNING_KEY", "a secret for the test")
    assert main.run(make_config(tmp_path, mode="test")) == 2
    assert errors(capsys) == [f"error: {path}/meta.json: the signature does not match (meta.json or a file's "
                              "recorded hash was changed after the save, or another key signed it)"]
    edit_meta(path, lambda meta: meta.pop("signature"))  # nor does removing the signature help
    with pytest.raises(Unloadable, match="meta.json: not signed, but CHECKPOINT_SIGNING_KEY"):
        checkpoint_io.verify(path)
    monkeypatch.setenv("CHECKPOINT_SIGNING_KEY", "another key")
    with pytest.raises(Unloadable, match="the signature does not match"):
        checkpoint_io.verify(ckpt(tmp_path, 1))


def test_a_key_file_signs_and_without_a_key_the_plan_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("CHECKPOINT_SIGNING_KEY", raising=False)
    assert run(tmp_path / "plain", train={"max_steps": 1}) == 0
    assert "checkpoints: sha256 of every file checked on load; not signed (set CHECKPOINT_SIGNING_KEY to sign " \
           "them)" in rank_log(tmp_path / "plain")
    assert "signature" not in checkpoint_meta.read(ckpt(tmp_path / "plain", 1))
    (tmp_path / "key").write_text("from a file\n")
    assert run(tmp_path / "signed", train={"max_steps": 1}, signing_key_file=str(tmp_path / "key")) == 0
    from core import checkpoint_signing
    meta = checkpoint_meta.read(ckpt(tmp_path / "signed", 1))
    assert meta["signature"] == checkpoint_signing.signature(meta, b"from a file")


def test_a_folder_of_checkpoints_named_as_one_is_told_which_to_name(reference, tmp_path, capsys):
    """test.checkpoint (or export's, predict's) given checkpoints/ or the output_dir: the line advised
    allow_unverified: true, which then failed on a missing model.pt; it names the step-N folders now."""
    crashed_copy(reference("none"), tmp_path, 3)
    for given in (str(tmp_path / "checkpoints"), str(tmp_path)):
        assert main.run(make_config(tmp_path / "other", mode="test", test={"checkpoint": given})) == 2
        assert errors(capsys) == [f"error: {given}: a folder of checkpoints, not one: name one of its step-N folders "
                                  f"(the newest: {ckpt(tmp_path, 3)})"]
