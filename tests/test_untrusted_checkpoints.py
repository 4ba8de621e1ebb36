"""Checkpoints are never trusted (issue 20, item 5; failures 6 and 7): pruning and cleanup touch only real
directories inside output_dir/checkpoints (a symlink is never followed), and every value read from meta.json is
checked, bounded in size and depth, so a tampered one is skipped with one line naming file and key (resume falls
back to an older checkpoint; test and export mode stop with exit code 2) instead of a traceback or a path outside
the run."""
import builtins
import json
import os
import shutil

import pytest
from PIL import Image

from conftest import load_model_state, make_config
from test_checkpoint_faults import STEPS, ckpt, crashed_copy, errors, rank_log, run, same_params

from core import checkpoint
from core.errors import Unloadable

from core import checkpoint_meta
from resilience import run_dir
import main


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps with a checkpoint at every step."""
    out = tmp_path_factory.mktemp("reference")
    assert run(out) == 0
    return out


def edit_meta(path, change):
    """Rewrite `path`/meta.json as `change(meta)` returns it (a dict, or the file's text)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = change(json.load(f))
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write(meta if isinstance(meta, str) else json.dumps(meta))


def set_key(key, value):
    """A change for edit_meta: `state.epoch` and the like set to `value`."""
    def change(meta):
        *parents, last = key.split(".")
        inner = meta
        for p in parents:
            inner = inner[p]
        inner[last] = value
        return meta
    return change


def deeply_nested(meta):
    return json.dumps(meta)[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"


def files_of(folder) -> dict:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


# ---- pruning and cleanup never follow a symlink -----------------------------------------------------------------
def test_training_with_keep_last_1_leaves_a_symlinked_checkpoints_target_intact(reference, tmp_path):
    """The issue's reproduction: checkpoints/step-1 -> a complete checkpoint elsewhere, train.keep_last=1."""
    elsewhere = tmp_path / "elsewhere" / "ck"
    shutil.copytree(ckpt(reference, 1), elsewhere)
    before = files_of(elsewhere)
    out = tmp_path / "run"
    os.makedirs(out / "checkpoints")
    os.symlink(elsewhere, ckpt(out, 1))
    assert run(out, train={"keep_last": 1}) == 0
    assert files_of(elsewhere) == before
    assert "resumed from" not in rank_log(out)  # a symlink is no checkpoint of this run
    # step-1 may remain as the link, or be replaced by this run's own step-1 (then pruned): never through it.
    assert [name for name in os.listdir(out / "checkpoints") if name != "step-1"] == [f"step-{STEPS}"]


def test_a_symlinked_checkpoint_named_by_the_user_is_refused_as_one(reference, tmp_path, capsys):
    """train.resume or test.checkpoint naming a symlinked step-N: the resume said "not a complete checkpoint
    directory" of a complete one. Refused as a symlink, in the words of the other symlink refusals."""
    shutil.copytree(ckpt(reference, 3), tmp_path / "elsewhere" / "step-3")
    out = tmp_path / "out"
    crashed_copy(reference, out, 2)
    link = ckpt(out, 3)
    os.symlink(tmp_path / "elsewhere" / "step-3", link)
    says = f"{link}: a symlink to a checkpoint (refused: it is never followed; a checkpoint is read from its own " \
           "folder)"
    assert run(out, train={"resume": link}) == 2
    assert errors(capsys) == [f"error: train.resume: {says}"]
    assert main.run(make_config(out, mode="test", test={"checkpoint": link})) == 2
    assert errors(capsys) == [f"error: {says}"]


def test_prune_and_clean_stale_act_on_real_directories_only(reference, tmp_path):
    base = tmp_path / "checkpoints"
    targets = {name: tmp_path / "elsewhere" / name for name in ("complete", "tmp", "half")}
    for name, target in targets.items():
        shutil.copytree(ckpt(reference, 1), target)
    os.remove(targets["half"] / "meta.json")  # what a step-N left by a killed prune looks like
    before = {name: files_of(target) for name, target in targets.items()}
    crashed_copy(reference, tmp_path, 3)
    os.remove(os.path.join(ckpt(tmp_path, 2), "meta.json"))  # a real leftover of a killed prune
    os.symlink(targets["complete"], ckpt(tmp_path, 7))
    os.symlink(targets["half"], ckpt(tmp_path, 8))
    os.symlink(targets["tmp"], base / ".tmp-step-9-0a1b2c3d")
    assert checkpoint.complete_checkpoints(str(tmp_path)) == [(1, ckpt(tmp_path, 1)), (3, ckpt(tmp_path, 3))]
    assert checkpoint.latest(str(tmp_path)) == ckpt(tmp_path, 3)
    # The symlinked .tmp-step is unlinked (the link only), the real leftover removed; a symlinked step-N is left.
    assert run_dir.clean_stale(str(tmp_path)) == [str(base / ".tmp-step-9-0a1b2c3d"), ckpt(tmp_path, 2)]
    checkpoint.prune(str(tmp_path), keep_last=1, keep=set())
    assert sorted(os.listdir(base)) == ["step-3", "step-7", "step-8"]
    assert {name: files_of(target) for name, target in targets.items()} == before


def test_a_stale_tmp_step_that_is_a_file_is_removed_too(tmp_path):
    """A `.tmp-step-*` that is a plain file (or a FIFO) stayed for ever, taking the space a save needs: removed
    like a folder leftover, by its name only."""
    base = tmp_path / "checkpoints"
    os.makedirs(base / "step-1")
    (base / "step-1" / "meta.json").write_text("{}")
    (base / ".tmp-step-5-0a1b2c3d").write_bytes(b"half")
    os.mkfifo(base / ".tmp-step-6-0a1b2c3d")
    assert run_dir.clean_stale(str(tmp_path)) == [str(base / ".tmp-step-5-0a1b2c3d"),
                                                  str(base / ".tmp-step-6-0a1b2c3d")]
    assert os.listdir(base) == ["step-1"]


def test_clean_stale_reports_only_what_it_removed(reference, tmp_path, monkeypatch):
    crashed_copy(reference, tmp_path, 1)
    os.makedirs(tmp_path / "checkpoints" / ".tmp-step-2-0a1b2c3d")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)  # as on a read-only folder
    assert run_dir.clean_stale(str(tmp_path)) == []


# ---- every value of meta.json is checked ------------------------------------------------------------------------
BAD_META = {  # name: (change, what the one line says after `.../step-4/meta.json: unreadable (`)
    "best_step a path": (set_key("state.best_step", "20/../../../outside/step-5"),
                         "`state.best_step` is '20/../../../outside/step-5', not a step of this run (0 to 4))"),
    "best_step after step": (set_key("state.best_step", 5), "`state.best_step` is 5, not a step of this run"),
    "best_step negative": (set_key("state.best_step", -1), "`state.best_step` is -1, not a step of this run"),
    "best_value a string": (set_key("state.best_value", "0.9"), "`state.best_value` is '0.9', not a finite number"),
    "best_value huge": (set_key("state.best_value", 10 ** 400), "`state.best_value` is 1000000"),
    "best_value NaN": (lambda m: json.dumps(m).replace('"best_value": null', '"best_value": NaN'),
                       "NaN is not a number JSON allows"),
    "best_loss a string": (set_key("state.best_loss", "0.3"), "`state.best_loss` is '0.3', not a finite number"),
    "epoch 1e30": (set_key("state.epoch", 1e30), "`state.epoch` is 1e+30, not a count from 0 to"),
    "epoch negative": (set_key("state.epoch", -1), "`state.epoch` is -1, not a count"),
    "batch_in_epoch a bool": (set_key("state.batch_in_epoch", True), "`state.batch_in_epoch` is True, not a count"),
    "evals_without_improvement a list": (set_key("state.evals_without_improvement", [1]),
                                         "`state.evals_without_improvement` is [1], not a count"),
    "step of another directory": (set_key("step", 3), "`step` is 3 but the directory is step-4)"),
    "step negative": (set_key("step", -4), "`step` is -4, not a step number)"),
    "state.step differs": (set_key("state.step", 2), "`state.step` is 2 but `step` is 4)"),
    "deeply nested": (deeply_nested, "JSON nested deeper than 32 levels)"),
    "over 16 MiB": (lambda m: json.dumps({**m, "padding": "x" * (16 << 20)}), "larger than 16 MiB"),
    "a 5000-digit number": (lambda m: json.dumps(m)[:-1] + ', "n": ' + "9" * 5000 + "}", "Exceeds the limit"),
    "metrics a list": (set_key("metrics", [1]), "`metrics` is [1], not a dict)"),
    "world_size 0": (set_key("world_size", 0), "`world_size` is 0, not a number of processes)"),
    "batch_sizes of strings": (set_key("batch_sizes", ["32"]), "`batch_sizes` is ['32'], not a list of batch sizes"),
    "config.train a list": (set_key("config.train", []), "`config.train` is not an object)"),
}


@pytest.mark.parametrize("name", list(BAD_META))
def test_read_meta_refuses_a_bad_value_in_one_line_naming_file_and_key(reference, tmp_path, name):
    change, says = BAD_META[name]
    shutil.copytree(ckpt(reference, 4), ckpt(tmp_path, 4))
    edit_meta(ckpt(tmp_path, 4), change)
    with pytest.raises(Unloadable) as caught:
        checkpoint_meta.read(ckpt(tmp_path, 4))
    message = str(caught.value)
    assert message.startswith(f"{ckpt(tmp_path, 4)}/meta.json: unreadable (") and says in message, message
    assert "\n" not in message and len(message) < 400, message


def test_read_meta_takes_a_real_one_and_values_the_trainer_writes(reference, tmp_path):
    shutil.copytree(ckpt(reference, 4), ckpt(tmp_path, 4))
    edit_meta(ckpt(tmp_path, 4), lambda m: set_key("state", {**m["state"], "best_step": 4, "best_value": -0.5,
                                                            "epoch": 3})(m))
    assert checkpoint_meta.read(ckpt(tmp_path, 4))["state"]["best_step"] == 4
    assert checkpoint_meta.best_recorded(str(tmp_path)) == ckpt(tmp_path, 4)


@pytest.mark.parametrize("name", ["best_value a string", "best_loss a string", "epoch 1e30", "deeply nested", "step of another directory",
                                  "best_step a path"])
def test_resume_falls_back_past_a_bad_meta_json(reference, tmp_path, name):
    change, says = BAD_META[name]
    crashed_copy(reference, tmp_path, 4)
    edit_meta(ckpt(tmp_path, 4), change)
    assert run(tmp_path) == 0
    log = rank_log(tmp_path)
    assert (f"resume: skipping {ckpt(tmp_path, 4)}, which cannot be loaded: {ckpt(tmp_path, 4)}/meta.json: "
            f"unreadable (") in log and says in log
    assert f"resumed from {ckpt(tmp_path, 3)} at step 3" in log
    assert same_params(load_model_state(tmp_path, STEPS), load_model_state(reference, STEPS))


def test_best_step_outside_the_run_is_refused_in_test_mode(reference, tmp_path, capsys):
    out = tmp_path / "run"
    crashed_copy(reference, out, 4)
    shutil.copytree(ckpt(reference, 2), tmp_path / "outside" / "step-5")
    traversal = "4/../../../outside/step-5"
    assert os.path.isfile(os.path.join(str(out / "checkpoints"), f"step-{traversal}", "meta.json"))  # it would load
    edit_meta(ckpt(out, 4), set_key("state.best_step", traversal))
    assert main.run(make_config(out, mode="test")) == 2
    assert errors(capsys) == [f"error: {ckpt(out, 4)}/meta.json: unreadable (`state.best_step` is '{traversal}', "
                              "not a step of this run (0 to 4))"]
    assert not any(name.endswith("_results.json") for name in os.listdir(out))


def test_best_step_outside_the_run_is_refused_in_export_mode(reference, tmp_path, capsys):
    out = tmp_path / "run"
    crashed_copy(reference, out, 4)
    shutil.copytree(ckpt(reference, 2), tmp_path / "outside" / "step-5")
    traversal = "4/../../../outside/step-5"
    edit_meta(ckpt(out, 4), set_key("state.best_step", traversal))
    assert main.run(make_config(out, mode="export", export={"dir": str(tmp_path / "export")})) == 2
    assert errors(capsys) == [f"error: {ckpt(out, 4)}/meta.json: unreadable (`state.best_step` is '{traversal}', "
                              "not a step of this run (0 to 4))"]
    assert not (tmp_path / "export").exists()


def test_best_never_names_a_symlinked_checkpoint(reference, tmp_path):
    crashed_copy(reference, tmp_path, 4)
    shutil.copytree(ckpt(reference, 2), tmp_path / "elsewhere")
    shutil.rmtree(ckpt(tmp_path, 2))
    os.symlink(tmp_path / "elsewhere", ckpt(tmp_path, 2))
    edit_meta(ckpt(tmp_path, 4), set_key("state.best_step", 2))
    assert checkpoint_meta.best_recorded(str(tmp_path)) == ckpt(tmp_path, 4)  # the latest, as when the best was pruned


def test_test_export_predict_and_resume_read_meta_json_once(reference, tmp_path, monkeypatch):
    # Each read meta.json twice: the verifying load (its files' record) and the caller again, unverified (the step,
    # the classes; a resume, its state): a meta.json swapped between the two was trusted. Now one record serves both.
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    crashed_copy(reference, out, 4)
    crashed_copy(reference, resumed, 4)
    path = ckpt(out, 3)
    os.makedirs(tmp_path / "new")
    Image.new("L", (8, 8), 128).save(tmp_path / "new" / "gray.png")
    reads = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file) in (os.path.join(path, "meta.json"), os.path.join(ckpt(resumed, 4), "meta.json")):
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    for mode, sections in [("test", {"test": {"checkpoint": path, "splits": ["dev"]}}),
                           ("export", {"test": {"checkpoint": path}, "export": {"dir": str(tmp_path / "export"),
                                                                                 "format": "state_dict"}}),
                           ("predict", {"predict": {"checkpoint": path, "input": str(tmp_path / "new")}})]:
        reads.clear()
        assert main.run(make_config(out, mode=mode, **sections)) == 0, mode
        assert len(reads) == 1, (mode, len(reads))
    reads.clear()  # and a resume (here of step-4): meta.json read once, the record verify checks the files by
    assert run(resumed) == 0 and f"resumed from {ckpt(resumed, 4)}" in rank_log(resumed)
    assert len(reads) == 1, ("resume", len(reads))
    assert os.path.isfile(tmp_path / "run" / "predictions.csv") and os.path.isfile(tmp_path / "run" / "dev_results.json")
