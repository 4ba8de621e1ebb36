"""Numbers the config refuses (issue 33, item 3): NaN, infinities and out-of-range values in the schema, in one line
naming the key and the value; a warm-up longer than the run and a global batch larger than the dataset at start."""
import math
import os

import pytest

import main
from core.config import in_range
from wiring import checked_config
from core.errors import ConfigError
from conftest import ROOT

PARAMS = os.path.join(ROOT, "parameters.yml")


def refused(tmp_path, *sets) -> str:
    """The one-line ConfigError of parameters.yml with `sets` (--set items), output_dir in tmp_path."""
    with pytest.raises(ConfigError) as e:
        checked_config(PARAMS, [f"output_dir={tmp_path}", *sets])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{PARAMS} + --set: "), message
    return message


@pytest.mark.parametrize("item, key, shown, words", [
    ("train.lr=nan", "train.lr", "nan", "a finite number > 0"),
    ("train.lr=.nan", "train.lr", "nan", "a finite number > 0"),
    ("train.lr=inf", "train.lr", "inf", "a finite number > 0"),
    ("train.lr=1.0e400", "train.lr", "inf", "a finite number > 0"),  # YAML reads it as an infinity
    ("train.epochs=inf", "train.epochs", "inf", "a finite number >= 0"),
    ("train.epochs=nan", "train.epochs", "nan", "a finite number >= 0"),
    ("train.warmup=nan", "train.warmup", "nan", "a finite number >= 0"),
    ("train.warmup=inf", "train.warmup", "inf", "a finite number >= 0"),  # was an OverflowError in the check
    ("train.eps=nan", "train.eps", "nan", "a finite number > 0"),
    ("train.weight_decay=nan", "train.weight_decay", "nan", "a finite number >= 0"),
    ("train.clip_grad_norm=nan", "train.clip_grad_norm", "nan", "a finite number >= 0"),
    ("train.clip_grad_norm=-.inf", "train.clip_grad_norm", "-inf", "a finite number >= 0"),
    ("train.time_limit=nan", "train.time_limit", "nan", "a finite number in [0, 31536000]"),
    ("train.time_limit=inf", "train.time_limit", "inf", "a finite number in [0, 31536000]"),
    ("train.time_limit=1e30", "train.time_limit", "1e+30", "in [0, 31536000]"),
    ("train.min_lr_ratio=nan", "train.min_lr_ratio", "nan", "between 0 and 1"),
    ("train.betas=[.nan, 0.999]", "train.betas", "nan", "two numbers in [0, 1)"),
    ("train.betas=[0.9, .inf]", "train.betas", "inf", "two numbers in [0, 1)"),
    ("train.max_steps=99999999999", "train.max_steps", "99999999999", "<= 2147483647"),
    ("train.batch_size=-3", "train.batch_size", "-3", ">= 1"),
    ("train.batch_size=[8, 99999999999]", "train.batch_size", "99999999999", "positive integers"),
    ("train.eval_batch_size=0", "train.eval_batch_size", "0", ">= 1"),
    ("seed=-1", "seed", "-1", "in [0, 4294967295]"),
    ("seed=18446744073709551616", "seed", "18446744073709551616", "in [0, 4294967295]"),  # 2**64
    ("seed=4294967296", "seed", "4294967296", "in [0, 4294967295]"),
    ("dist.timeout_s=0", "dist.timeout_s", "0", "in (0, 31536000]"),
    ("dist.timeout_s=-5", "dist.timeout_s", "-5", "in (0, 31536000]"),
    ("dist.timeout_s=99999999999999999", "dist.timeout_s", "99999999999999999", "in (0, 31536000]"),
    ("dist.hang_timeout_s=nan", "dist.hang_timeout_s", "nan", "a finite number in [0, 31536000]"),
    ("dist.hang_timeout_s=-1", "dist.hang_timeout_s", "-1.0", "in [0, 31536000]"),
    ("dist.nodes=10000000000", "dist.nodes", "10000000000", "in [1, 100000]"),
    ("dist.procs_per_node=10000000000", "dist.procs_per_node", "10000000000", "in [1, 100000]"),
    ("dist.simulate_slowdown=[.inf]", "dist.simulate_slowdown", "inf", "a finite number >= 1"),
    ("model.dropout=nan", "model.dropout", "nan", "a finite number in [0, 1)"),
    ("model.dropout=1", "model.dropout", "1.0", "in [0, 1)"),
    ("model.lora_alpha=nan", "model.lora_alpha", "nan", "a finite number > 0"),
    ("model.lora_dropout=inf", "model.lora_dropout", "inf", "a finite number in [0, 1)"),
    ("model.channels=0", "model.channels", "0", ">= 1"),
    ("model.width=99999999999", "model.width", "99999999999", "<= 2147483647"),
    ("data.dev_fraction=nan", "data.dev_fraction", "nan", "a finite number in [0, 1)"),
    ("data.max_length=99999999999", "data.max_length", "99999999999", "<= 2147483647"),
    ("data.num_workers=100000", "data.num_workers", "100000", "in [0, 1024]"),
])
def test_numbers_out_of_range_are_refused_naming_key_and_value(tmp_path, item, key, shown, words):
    message = refused(tmp_path, item)
    assert f"`{key}` must " in message and words in message and shown in message.split(" got ")[-1], message


def test_values_in_range_still_load(tmp_path):
    cfg = checked_config(PARAMS, [f"output_dir={tmp_path}", "seed=0", "train.lr=1e-3", "train.warmup=0.1",
                                  "train.time_limit=01:00:00", "dist.timeout_s=60", "dist.hang_timeout_s=0",
                                  "train.epochs=0.5", "model.dropout=0", "seed=4294967295"])
    assert cfg.seed == 2**32 - 1 and cfg.train.warmup == 0.1 and cfg.dist.hang_timeout_s == 0


def test_in_range_is_one_line_per_check():
    def fail(key, why):
        raise ConfigError(f"`{key}` {why}")
    for value, kwargs, expected in [
            (math.nan, dict(above=0), "`k` must be a finite number > 0, got nan"),
            (-1.0, dict(above=0), "`k` must be > 0, got -1.0"),
            (0.5, dict(at_least=0, below=0.5), "`k` must be in [0, 0.5), got 0.5"),
            (math.inf, dict(at_least=0, at_most=1), "`k` must be a finite number in [0, 1], got inf"),
            (2**40, dict(at_least=1), "`k` must be <= 2147483647, got 1099511627776"),
            (0, dict(at_least=1), "`k` must be >= 1, got 0")]:
        with pytest.raises(ConfigError) as e:
            in_range(fail, "k", value, **kwargs)
        assert str(e.value) == expected
    for value, kwargs in [(0.0, dict(at_least=0)), (1, dict(at_least=1)), (2**31 - 1, dict(at_least=0)),
                          (0.999, dict(at_least=0, below=1))]:
        in_range(fail, "k", value, **kwargs)  # no failure


# ---- output_dir -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, what", [
    ("/", "the root folder"), ("/etc", "a system folder"), ("/usr", "a system folder"), ("/var", "a system folder"),
    ("/proc/self", "inside a system folder"), ("/etc/runs", "inside a system folder"),
    ("/usr/lib/runs", "inside a system folder"), ("/usr/local", "a system folder"), ("/boot", "a system folder"),
    ("/root", None),
])
def test_output_dir_that_is_root_or_a_system_folder_is_refused(tmp_path, path, what):
    message = refused(tmp_path, f"output_dir={path}")
    assert "`output_dir` is " in message and repr(path) in message, message
    assert what is None or what in message, message


def test_output_dir_that_is_home_is_refused_after_resolving_links(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert "is your home folder" in refused(tmp_path, f"output_dir={home}")
    assert "is your home folder" in refused(tmp_path, f"output_dir={home}/runs/..")
    os.symlink("/", tmp_path / "top")
    assert "is the root folder" in refused(tmp_path, f"output_dir={tmp_path / 'top'}")
    os.symlink("/etc", tmp_path / "conf")
    assert "inside a system folder" in refused(tmp_path, f"output_dir={tmp_path / 'conf' / 'runs'}")
    assert checked_config(PARAMS, [f"output_dir={home}/runs/digits"]).output_dir == f"{home}/runs/digits"
    for fine in ("/dev/shm/run", "/usr/src/app/runs/digits", "/var/tmp/run", "/tmp/run", "runs/digits"):
        assert checked_config(PARAMS, [f"output_dir={fine}"]).output_dir == fine


# ---- end to end: one line on stderr, exit code 2, nothing run --------------------------------------------------
@pytest.mark.parametrize("sets, words", [
    (["train.lr=nan"], "`train.lr` must be a finite number > 0, got nan"),
    (["train.lr=inf"], "`train.lr` must be a finite number > 0, got inf"),  # was "training diverged at step 1"
    (["dist.timeout_s=0"], "`dist.timeout_s` must be in (0, 31536000], got 0"),  # was 84 lines of c10d errors
    (["seed=-1"], "`seed` must be in [0, 4294967295], got -1"),
    (["output_dir=/"], "`output_dir` is the root folder ('/')"),
    (["train.max_steps=-1"], "`train.max_steps` must be >= 0, got -1"),  # was a note on its length first
    (["data.group_by_length=true"], "`data.group_by_length` is set, but task image has no sample lengths"),  # ignored
    # said by the schema, before the ranks start (the trainer said it from inside the first rank, seconds later)
    (["train.warmup=500", "train.max_steps=3"], "`train.warmup` is 500 steps, longer than the run (train.max_steps=3)"),
    # both blamed dist.dp_replicate, at its default: "x dist.tp (1 x 2) must divide the world size (1)"
    (["dist.tp=2"], "`dist.tp` is 2, which composes with dist.strategy ddp, fsdp (FSDP2) or pipe only, not none"),
    (["dist.tp=2", "dist.strategy=ddp", "dist.procs_per_node=3"], "`dist.tp` is 2; it must divide the world size (3"),
    # ignored without a word (the rendezvous file is where the ranks meet)
    (["dist.init_method=file:///tmp/meet", "dist.master_addr=node0"], "`dist.master_addr` is not read with "
     "dist.init_method file:///tmp/meet (the ranks meet in that file); remove it"),
    # the average's metric where there is none under that name: refused at the first evaluation, after training
    (["train.best_metric=ema_loss"], "`train.best_metric` is 'ema_loss', the weight average's, but train.ema_decay "
                                     "is 0: there is no average"),
    (["train.best_metric=ema_accuracy", "train.ema_decay=0.9", "train.eval_ema=true"],
     "`train.best_metric` is 'ema_accuracy', but train.eval_ema names the average's metrics as the weights' are: "
     "use 'accuracy'"),
])
def test_main_says_a_bad_number_in_one_line_and_exits_2(tmp_path, capsys, sets, words):
    args = ["--params", PARAMS, "--set", f"output_dir={tmp_path / 'run'}"]
    for item in sets:
        args += ["--set", item]
    assert main.main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and words in err and err.count("\n") == 1 and not out, (out, err)
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("sets, words", [
    (["train.warmup=50", "train.epochs=1", "train.max_steps=0", "train.batch_size=256"],
     "`train.warmup` is 50 steps, longer than the run (5 optimizer steps: epochs=1)"),
    (["train.batch_size=1000000000"], "the global batch (1000000000 samples over all ranks) is larger than the "
                                      "training set (1272 samples)"),
])
def test_a_run_that_makes_no_sense_is_refused_at_start(tmp_path, capsys, sets, words):
    args = ["--params", PARAMS, "--set", f"output_dir={tmp_path}", "--set", "log.progress_bar=false",
            "--set", "log.tensorboard=false"]
    for item in sets:
        args += ["--set", item]
    assert main.main(args) == 2
    captured = capsys.readouterr()
    assert words in captured.err and captured.err.count("\n") == 1, captured.err
    assert "global batch" not in captured.out  # refused before the plan, before step 1
    assert not os.path.isdir(tmp_path / "checkpoints")


def test_warmup_as_long_as_the_run_or_a_fraction_is_accepted(tmp_path):
    from core import process_group
    from wiring import build_task
    from wiring import build_trainer
    for warmup in (3, 0.5):
        cfg = checked_config(PARAMS, [f"output_dir={tmp_path}", "train.max_steps=3", "train.epochs=0",
                                      f"train.warmup={warmup}", "log.progress_bar=false", "log.tensorboard=false"])
        assert build_trainer(cfg, process_group.init(cfg, 0, 1, 0)).total_steps == 3


def test_a_path_written_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """`output_dir: ~/runs/x` made a folder named `~` in the working directory (YAML and --set keep the `~` a shell
    would expand): every path key is expanded as a shell would."""
    import yaml
    from core.config import read_config
    monkeypatch.setenv("HOME", str(tmp_path))
    params = tmp_path / "p.yml"
    params.write_text(yaml.safe_dump({"output_dir": "~/runs/x", "data": {"data_dir": "~/data"}}))
    cfg = read_config(str(params), ["test.checkpoint=~/runs/x/checkpoints/step-1", "predict.input=~/new.csv"])
    assert cfg.output_dir == f"{tmp_path}/runs/x" and cfg.data.data_dir == f"{tmp_path}/data"
    assert cfg.test.checkpoint == f"{tmp_path}/runs/x/checkpoints/step-1" and cfg.predict.input == f"{tmp_path}/new.csv"
    assert read_config(None, ["output_dir=runs/~x"]).output_dir == "runs/~x"  # a ~ inside a name stays


def test_a_key_of_another_strategy_is_one_line_naming_who_reads_it(tmp_path):
    """dist.pp_* under ddp, fsdp's reshard_after_forward under ddp, oss_impl under fsdp: did nothing, silently
    (dist.shard_grads alone was refused). Set by the user away from its default, each is one line naming the
    strategy that reads it; at its default (parameters.yml lists them all) or under its reader, it is taken."""
    for sets, key, readers, strategy in [
            (["dist.strategy=ddp", "dist.procs_per_node=2", "dist.pp_stages=4"], "pp_stages", "pipe", "ddp"),
            (["dist.strategy=ddp", "dist.reshard_after_forward=false"], "reshard_after_forward", "fsdp or pipe", "ddp"),
            (["dist.strategy=fsdp", "dist.oss_impl=torch"], "oss_impl", "oss", "fsdp"),
            (["dist.pp_dp=fsdp"], "pp_dp", "pipe", "none"),
            (["dist.strategy=ddp", "dist.shard_grads=true"], "shard_grads", "oss", "ddp")]:
        assert refused(tmp_path, *sets).endswith(f": `dist.{key}` is read by dist.strategy {readers} only, not "
                                                 f"{strategy}, where it would do nothing; remove it")
    assert refused(tmp_path, "dist.strategy=pipe", "dist.procs_per_node=2", "dist.pp_microbatches=2",
                   "dist.reshard_after_forward=false").endswith(
        ": `dist.reshard_after_forward` is read under pipe with dist.pp_dp: fsdp only (ddp keeps each stage whole), "
        "where it would do nothing; remove it")
    for sets in (["dist.strategy=fsdp", "dist.reshard_after_forward=false"],
                 ["dist.strategy=ddp", "dist.pp_stages=2", "dist.fsdp_impl=torch", "dist.reshard_after_forward=true"],
                 ["dist.strategy=pipe", "dist.procs_per_node=2", "dist.pp_microbatches=2", "dist.pp_dp=fsdp",
                  "dist.reshard_after_forward=false"]):
        assert checked_config(PARAMS, [f"output_dir={tmp_path}", *sets]).dist.strategy == sets[0].split("=")[1]
