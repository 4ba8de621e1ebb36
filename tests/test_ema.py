"""train.ema_decay (issue 41): an exponential moving average of the trainable weights, updated after each optimizer
step under every strategy (under pipe each stage its own layers), saved as a whole state dict (ema.pt, hashed like every file), exact across a
resume and read back after the weights reshard; evaluated beside the weights (or alone: train.eval_ema); test mode
reads it with test.weights: ema."""
import dataclasses
import json
import os
import re
import shutil

import pytest
import torch

import main
from conftest import load_model_state, make_config, slow
from test_text_tasks import train

DECAY = 0.8


def ema_config(out, steps: int, **dist):
    return make_config(out, model={"dropout": 0.0},
                       train={"max_steps": steps, "epochs": 0, "save_every": 1, "keep_last": 20, "eval_every": 4,
                              "ema_decay": DECAY, "lr": 3e-3, "batch_size": 32 // dist.get("procs_per_node", 1)},
                       dist=dist)


def ema_at(out, step: int) -> dict:
    return torch.load(os.path.join(out, "checkpoints", f"step-{step}", "ema.pt"), weights_only=True)


def run(cfg, world: int):
    if world == 1:
        train(cfg, 1)
    else:
        assert main.run(cfg) == 0


def check_recurrence(out, first: int, last: int):
    """ema_t = decay * ema_(t-1) + (1 - decay) * weights_t, checkpoint after checkpoint."""
    for step in range(first + 1, last + 1):
        before, now, weights = ema_at(out, step - 1), ema_at(out, step), load_model_state(out, step)
        assert set(now) == {k for k in weights if k in now} and len(now) > 0
        for name in now:
            expected = DECAY * before[name] + (1 - DECAY) * weights[name]
            assert torch.allclose(now[name], expected, atol=1e-6), name


@pytest.mark.parametrize("world, dist", [(1, {}), (2, {"strategy": "ddp", "procs_per_node": 2}),
                                          slow(2, {"strategy": "fsdp", "procs_per_node": 2})])
def test_the_average_follows_the_weights_and_resumes_exactly(tmp_path, world, dist):
    cfg = ema_config(tmp_path, 8, **dist)
    run(cfg, world)
    if dist.get("strategy") != "fsdp":  # (fsdp's weights are sharded DCP files: the reshard test below reads them)
        check_recurrence(str(tmp_path), 1, 8)
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert re.search(r"step 8 dev: loss=", log) and re.search(r"step 8 dev_ema: loss=", log)
    meta = json.load(open(tmp_path / "checkpoints" / "step-8" / "meta.json"))
    assert "ema.pt" in meta["files"] and "ema_accuracy" in meta["metrics"]
    straight = ema_at(str(tmp_path), 8)
    for step in range(6, 9):  # "the machine died after step 5": the same command resumes from step-5
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step}")
    run(cfg, world)
    assert "resumed from" in open(tmp_path / "logs" / "rank0.log").read()
    for name, value in straight.items():
        assert torch.equal(value, ema_at(str(tmp_path), 8)[name]), name  # bit-exact across the resume


@pytest.mark.slow
def test_an_fsdp_average_resumes_in_one_process_after_the_weights_reshard(tmp_path):
    run(ema_config(tmp_path, 4, strategy="fsdp", procs_per_node=2), 2)
    run(ema_config(tmp_path, 6), 1)  # 2 sharded ranks -> one process: the whole average, loaded again
    check_recurrence(str(tmp_path), 4, 6)


def test_test_mode_reads_the_average_with_test_weights_ema(tmp_path, capsys):
    cfg = ema_config(tmp_path, 8)
    run(cfg, 1)
    log = open(tmp_path / "logs" / "rank0.log").read()
    last_ema = dict(re.findall(r"(\w+)=(\S+)", re.findall(r"step 8 dev_ema: (.*)", log)[-1]))
    test = dataclasses.replace(cfg, mode="test", test=dataclasses.replace(cfg.test, splits=["dev"], weights="ema",
                                                                           checkpoint=str(tmp_path / "checkpoints" /
                                                                                          "step-8")))
    assert main.run(test) == 0
    results = json.load(open(tmp_path / "dev_results.json"))
    assert results["weights"] == "ema"  # (results of the trained weights say "trained")
    default = dataclasses.replace(test, test=dataclasses.replace(test.test, weights="auto"))
    assert main.run(default) == 0  # auto: the trained weights picked the best (train.eval_ema false)
    assert json.load(open(tmp_path / "dev_results.json"))["weights"] == "trained"
    got = results["metrics"]
    assert got["loss"] == pytest.approx(float(last_ema["loss"]), rel=1e-3)
    assert got["accuracy"] == pytest.approx(float(last_ema["accuracy"]), abs=1e-3)
    plain = make_config(tmp_path / "plain", train={"max_steps": 2, "epochs": 0})
    run(plain, 1)
    no_ema = dataclasses.replace(plain, mode="test", test=dataclasses.replace(plain.test, weights="ema"))
    assert main.run(no_ema) == 2
    assert "holds no weight average (ema.pt)" in capsys.readouterr().err


def test_eval_ema_evaluates_and_picks_the_best_by_the_average_alone(tmp_path):
    cfg = ema_config(tmp_path, 4)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_ema=True))
    run(cfg, 1)
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert re.search(r"step 4 dev_ema: ", log) and not re.search(r"step 4 dev: ", log)
    # test.weights auto (the default): the weights that picked the best, here the average; asked, the trained ones
    last_ema = float(re.findall(r"step 4 dev_ema: loss=(\S+)", log)[-1])
    for asked, read in (("auto", "ema"), ("trained", "trained")):
        test = dataclasses.replace(cfg, mode="test", test=dataclasses.replace(cfg.test, splits=["dev"], weights=asked))
        assert main.run(test) == 0
        results = json.load(open(tmp_path / "dev_results.json"))
        assert results["weights"] == read
        assert (results["metrics"]["loss"] == pytest.approx(last_ema, rel=1e-3)) == (read == "ema")
    assert "with its weight average (ema.pt: test.weights auto: the run picked its best by it)" in \
        open(tmp_path / "logs" / "rank0.log").read()
    # the export's README: the dev metrics are the average's, never shown as the trained weights' (they were said
    # as theirs, "dev: loss=...", where test.weights trained exported the weights that were not evaluated)
    for asked in ("auto", "trained"):
        export = dataclasses.replace(cfg, mode="export", test=dataclasses.replace(cfg.test, weights=asked),
                                     export=dataclasses.replace(cfg.export, format="state_dict",
                                                                dir=str(tmp_path / f"export-{asked}")))
        assert main.run(export) == 0
        readme = open(tmp_path / f"export-{asked}" / "README.md").read()
        said = re.search(r"\(step 4\); (.*?): loss=(\S+),", readme)
        assert float(said.group(2)) == pytest.approx(last_ema, rel=1e-3), readme
        assert said.group(1) == ("dev" if asked == "auto" else
                                 "dev of its weight average (train.eval_ema; these trained weights were not evaluated)")


def test_best_metric_ema_loss_picks_the_lowest_loss_of_the_average(tmp_path):
    cfg = ema_config(tmp_path, 8)
    run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, best_metric="ema_loss", keep_last=1)), 1)
    losses = {int(step): float(loss) for step, loss in
              re.findall(r"step (\d+) dev_ema: loss=(\S+)", open(tmp_path / "logs" / "rank0.log").read())}
    assert sorted(losses) == [4, 8] and losses[4] != losses[8]
    meta = json.load(open(tmp_path / "checkpoints" / "step-8" / "meta.json"))
    assert meta["state"]["best_step"] == min(losses, key=losses.get)


def test_a_resume_that_turns_eval_ema_on_or_off_ranks_the_best_anew_and_says_so(tmp_path):
    """train.eval_ema turned on at a resume: the average's accuracy was compared with the best of the trained
    weights' (higher, so no improvement), and patience, counting on, stopped the run at its first evaluation."""
    cfg = ema_config(tmp_path, 6)
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_every=6, eval_every=2))
    run(first, 1)
    for steps, eval_ema in ((8, True), (10, False)):
        then = dataclasses.replace(first, train=dataclasses.replace(first.train, max_steps=steps, patience=1,
                                                                    eval_ema=eval_ema))
        run(then, 1)
        log = open(tmp_path / "logs" / "rank0.log").read()
        assert (f"resuming with train.eval_ema {not eval_ema} -> {eval_ema}: the best checkpoint and train.patience "
                f"count from step {steps - 2} on") in log
        meta = json.load(open(tmp_path / "checkpoints" / f"step-{steps}" / "meta.json"))
        assert meta["state"]["best_step"] == steps and meta["state"]["evals_without_improvement"] == 0
        assert meta["state"]["best_value"] == meta["metrics"]["accuracy"]  # the average's, then the weights'


@pytest.mark.slow
def test_under_pipe_each_stage_averages_its_own_layers_as_one_process_does_and_resumes_exactly(tmp_path):
    """2 stages in 2 processes against one process, SGD (as tests/test_pipeline.py: the update follows the
    gradient, so only the order of sums differs); ema.pt is the stages' parts put together."""
    def config(out, **dist):
        cfg = ema_config(out, 6, **dist)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=32, optimizer="sgd", lr=0.05,
                                                                  eval_every=3))
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    run(config(one), 1)
    cfg = config(pipe, strategy="pipe", procs_per_node=2)
    run(cfg, 2)
    averaged, reference = ema_at(str(pipe), 6), ema_at(str(one), 6)
    assert set(averaged) == set(reference) and len(averaged) > 2
    for name in reference:
        assert torch.allclose(averaged[name], reference[name], atol=1e-5), name
        assert not torch.allclose(averaged[name], load_model_state(str(one), 6)[name]), name  # not the weights
    last_ema = re.findall(r"step 6 dev_ema: loss=(\S+)", open(pipe / "logs" / "rank0.log").read())[-1]
    test = dataclasses.replace(cfg, mode="test", test=dataclasses.replace(
        cfg.test, splits=["dev"], weights="ema", checkpoint=str(pipe / "checkpoints" / "step-6")))
    assert main.run(test) == 0  # one process reads the stages' average put together
    assert json.load(open(pipe / "dev_results.json"))["metrics"]["loss"] == pytest.approx(float(last_ema), rel=1e-3)
    for step in (4, 5, 6):
        shutil.rmtree(pipe / "checkpoints" / f"step-{step}")
    run(cfg, 2)
    assert "resumed from" in open(pipe / "logs" / "rank0.log").read()
    for name, value in averaged.items():
        assert torch.equal(value, ema_at(str(pipe), 6)[name]), name  # bit-exact across the resume


def test_batchnorm_statistics_are_averaged_with_the_weights_and_an_older_average_still_resumes(tmp_path, capsys):
    """A ResNet's running statistics follow the recurrence too (as timm and Lightning average them), so the average is
    evaluated with statistics of its own; its integer count is not averaged. An ema.pt written before (parameters
    alone) resumes: the buffers' average starts from the loaded values, said in one line."""
    from image_folders import digit_folder
    from test_checkpoint_faults import rehash
    from test_image_folder import tiny
    folder = digit_folder(tmp_path / "digits", train=8, val=4)
    cfg = tiny(tmp_path / "run", folder, train={"max_steps": 4, "save_every": 1, "eval_every": 2, "ema_decay": DECAY,
                                                 "batch_size": 8})
    assert main.run(cfg) == 0
    out = str(tmp_path / "run")
    averaged = ema_at(out, 4)
    buffers = [k for k in averaged if k.endswith(("running_mean", "running_var"))]
    assert buffers and not any(k.endswith("num_batches_tracked") for k in averaged)
    check_recurrence(out, 1, 4)  # every entry, buffers included
    assert not all(torch.equal(averaged[k], load_model_state(out, 4)[k]) for k in buffers)
    dev_ema = re.findall(r"step 4 dev_ema: loss=(\S+)", open(tmp_path / "run" / "logs" / "rank0.log").read())[-1]
    test = dataclasses.replace(cfg, mode="test", test=dataclasses.replace(cfg.test, splits=["dev"], weights="ema"))
    assert main.run(test) == 0  # the average with its own statistics: the score training logged
    assert json.load(open(tmp_path / "run" / "dev_results.json"))["metrics"]["loss"] == pytest.approx(
        float(dev_ema), rel=1e-3)

    step3 = os.path.join(out, "checkpoints", "step-3")  # as an older version wrote it: parameters alone
    torch.save({k: v for k, v in ema_at(out, 3).items() if k not in buffers}, os.path.join(step3, "ema.pt"))
    rehash(step3)
    shutil.rmtree(os.path.join(out, "checkpoints", "step-4"))
    capsys.readouterr()
    assert main.run(cfg) == 0
    log = open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert re.search(r"ema\.pt averages no buffers \(\S*running_mean, \.\.\.", log)
    resumed, weights3 = ema_at(out, 4), load_model_state(out, 3)
    for k in buffers:  # started from step 3's statistics, one step of the recurrence after
        assert torch.allclose(resumed[k], DECAY * weights3[k] + (1 - DECAY) * load_model_state(out, 4)[k], atol=1e-6)


@pytest.mark.slow
def test_under_pipe_replicas_ema_pt_holds_the_first_pipelines_statistics_that_evaluation_used(tmp_path):
    """2 pipelines of one stage: each replica's average of BatchNorm's statistics follows its own batches; evaluation
    uses the first pipeline's (as share_buffers does), so ema.pt must hold those, not the last pipeline's."""
    from image_folders import digit_folder
    from test_image_folder import tiny
    folder = digit_folder(tmp_path / "digits", train=8, val=4)
    cfg = tiny(tmp_path / "run", folder, train={"max_steps": 2, "save_every": 2, "eval_every": 2, "ema_decay": DECAY,
                                                 "batch_size": 8}, dist={"strategy": "pipe", "pp_stages": 1,
                                                                         "procs_per_node": 2})
    assert main.run(cfg) == 0
    dev_ema = re.findall(r"step 2 dev_ema: loss=(\S+)", open(tmp_path / "run" / "logs" / "rank0.log").read())[-1]
    test = dataclasses.replace(cfg, mode="test", test=dataclasses.replace(cfg.test, splits=["dev"], weights="ema"))
    assert main.run(test) == 0
    assert json.load(open(tmp_path / "run" / "dev_results.json"))["metrics"]["loss"] == pytest.approx(
        float(dev_ema), rel=1e-3)


@pytest.mark.slow
def test_under_pipe_fsdp_replicas_the_tied_embeddings_copies_are_averaged_by_one_name(tmp_path):
    """GPT-2's head is its token embedding: under pp_dp fsdp each end stage's copy is its own object, yet ema.pt
    names it once, as one process does (lm_head.weight was refused by test mode and a resume in one process)."""
    import random
    from test_pipeline import lm_run
    from test_text_tasks import sample
    text = sample.write_gpt2(str(tmp_path / "text"), random.Random(0))
    out = tmp_path / "run"
    assert lm_run(out, text, {"strategy": "pipe", "pp_dp": "fsdp", "procs_per_node": 4}, "gpt2", batch_size=4,
                  max_steps=2, ema_decay=DECAY) == 0
    averaged = ema_at(str(out), 2)
    assert "transformer.wte.weight" in averaged and "lm_head.weight" not in averaged
    dev_ema = re.findall(r"step 2 dev_ema: loss=(\S+)", open(out / "logs" / "rank0.log").read())[-1]
    test = make_config(out, mode="test", task="gpt2_lm", data={"data_dir": text, "max_length": 16},
                       model={"name": "tiny", "layers": 2, "heads": 4, "width": 32, "arch": "gpt2"},
                       test={"splits": ["dev"], "weights": "ema"})
    assert main.run(test) == 0  # the average with its head tied, as the pipeline evaluated it
    assert json.load(open(out / "dev_results.json"))["metrics"]["loss"] == pytest.approx(float(dev_ema), rel=1e-3)
