"""Pipeline parallelism (dist.strategy: pipe) on gloo processes on CPU: every schedule trains like one process,
2 stages x 2 pipelines too (DDP or FSDP2 replicas, uneven or measured batches), tied weights (GPT-2), BERT's and
BART's chains, exact resume, checkpoints carried over to and from one process, test mode on one process, only a
rank's own stage on its device, auto split, and one-line errors for what pipe cannot do."""
import json
import os
import re
import types

import pytest
import torch

from conftest import free_port, logged, make_config, slow, spawn
from test_sharded import assert_close, params

STEPS, SAVE_AT = 6, 3
# As in test_sharded: SGD (its update is proportional to the gradient, so a wrong loss scale or clipping factor
# shows), accumulation over 2 batches (two schedule steps per optimizer step), clipping on every step (the global
# norm over all stages is ~0.35-0.46), no dropout. Only the order of floating-point sums differs from one process.
TRAIN = {"max_steps": STEPS, "save_every": SAVE_AT, "eval_every": SAVE_AT, "keep_last": 5, "grad_accum_steps": 2,
         "clip_grad_norm": 0.1, "optimizer": "sgd", "lr": 0.05, "log_every": 1, "eval_batch_size": 50}
MODEL = {"dropout": 0.0}
TOL = 1e-5  # measured ~1e-8; parameters move ~1e-3 over the run


def train(output_dir, batch_size, procs, dist=None, **train):
    from main import run
    section = {"strategy": "pipe", "procs_per_node": procs, **(dist or {})} if procs > 1 else {"strategy": "none"}
    cfg = make_config(output_dir, model=MODEL, train={**TRAIN, "batch_size": batch_size, **train}, dist=section)
    return run(cfg)


def meta(output_dir, step):
    with open(os.path.join(output_dir, "checkpoints", f"step-{step}", "meta.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, batch 16 (= 2 pipelines of 8, or 4 + 12)."""
    out = tmp_path_factory.mktemp("none")
    assert train(out, 16, 1) == 0
    return out


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory):
    """2 stages, 1f1b (the default schedule), batch 16: pipe checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("pipe")
    assert train(out, 16, 2) == 0
    return out


# quick loop: 1f1b, the default schedule, whose run the other tests resume
@pytest.mark.parametrize("schedule", [slow("gpipe"), "1f1b", slow("interleaved_1f1b"), slow("zero_bubble")])
def test_each_schedule_trains_like_one_process(one_process, pipe_run, tmp_path, schedule):
    # 2 ranks; the interleaved schedules put 2 of the CNN's 4 layers' stages on each rank (4 stages in all).
    out = pipe_run if schedule == "1f1b" else tmp_path
    if schedule != "1f1b":
        assert train(out, 16, 2, {"pp_schedule": schedule}) == 0
    assert_close(params(out, STEPS), params(one_process, STEPS), TOL)
    # Evaluation through the stages counts every dev sample once: the same metrics as one process.
    ours, ref = meta(out, STEPS)["metrics"], meta(one_process, STEPS)["metrics"]
    assert ours["samples"] == ref["samples"] > 0
    assert ours["accuracy"] == ref["accuracy"] and abs(ours["loss"] - ref["loss"]) < 1e-5


@pytest.mark.slow
def test_an_interleaved_schedule_of_one_stage_per_pipeline_evaluates_and_trains_like_one_process(one_process,
                                                                                                 tmp_path):
    """pp_stages 1 with an interleaved schedule: both stages of each of the 2 pipelines on one rank. Evaluation
    (and batch_size auto's timing) passes the first stage's output to the second on the rank itself, which gloo
    refused as a send to oneself ("Invalid destination rank"), at the first evaluation."""
    assert train(tmp_path, 8, 2, {"pp_stages": 1, "pp_schedule": "interleaved_1f1b"}) == 0
    timed = tmp_path / "auto"  # batch_size auto times each rank's stages: its inputs pass through them first
    assert train(timed, "auto", 2, {"pp_stages": 1, "pp_schedule": "interleaved_1f1b"}, global_batch_size=16) == 0
    assert_close(params(tmp_path, STEPS), params(one_process, STEPS), TOL)
    ours, ref = meta(tmp_path, STEPS)["metrics"], meta(one_process, STEPS)["metrics"]
    assert ours["samples"] == ref["samples"] > 0
    assert ours["accuracy"] == ref["accuracy"] and abs(ours["loss"] - ref["loss"]) < 1e-5


@pytest.mark.slow
def test_zero_bubble_over_two_pipelines_trains_like_one_process(one_process, tmp_path):
    """2 stages x 2 pipelines, zero_bubble, pp_dp ddp: its backward comes in two parts (input gradients, then
    weight gradients later), which DDP-wrapped stages crashed on at the first step (an internal assert of DDP's
    reducer); the replicas average their gradients after the schedule instead, uneven batches weighted exactly."""
    assert train(tmp_path, [4, 12], 4, {"pp_schedule": "zero_bubble"}) == 0
    assert_close(params(tmp_path, STEPS), params(one_process, STEPS), TOL)


@pytest.mark.slow
def test_ddp_replicas_sum_once_per_step_without_accumulation_too(tmp_path):
    """2 stages x 2 pipelines, pp_dp ddp, gpipe, 2 micro-batches, no accumulation. The stages were DDP-wrapped: each
    micro-batch's forward went through DDP outside no_sync, so every micro-batch's backward all-reduced the whole
    gradient again, which summed gradients would count twice (an average hid it); the replicas sum by hand now."""
    assert train(tmp_path / "pipe", 8, 4, {"pp_dp": "ddp", "pp_schedule": "gpipe", "pp_microbatches": 2},
                 grad_accum_steps=1) == 0
    assert train(tmp_path / "one", 16, 1, grad_accum_steps=1) == 0
    assert_close(params(tmp_path / "pipe", STEPS), params(tmp_path / "one", STEPS), TOL)


@pytest.mark.parametrize("pp_dp, batch", [slow("ddp", [4, 12]), ("fsdp", 8)])
def test_two_stages_times_two_pipelines(one_process, tmp_path, pp_dp, batch):
    # 4 ranks: stages on ranks {0,1} and {2,3}, pipelines {0,2} and {1,3}; uneven batches are weighted exactly.
    # The fsdp case starts from one process's step-3 checkpoint: each replica cuts its shard of its stage's
    # parameters and momentum from the whole tensors (checkpoint_io.shard_like), and steps 4-6 still match.
    if pp_dp == "fsdp":
        import shutil
        shutil.copytree(one_process / "checkpoints" / f"step-{SAVE_AT}", tmp_path / "checkpoints" / f"step-{SAVE_AT}")
    assert train(tmp_path, batch, 4, {"pp_dp": pp_dp}, resume="auto") == 0
    assert_close(params(tmp_path, STEPS), params(one_process, STEPS), TOL)
    with open(tmp_path / "logs" / "rank0.log") as f:
        log = f.read()
    assert "pipe: 2 pipeline(s) of 2 ranks, 2 stages" in log and "stage 0 on ranks 0-1, stage 1 on ranks 2-3" in log


@pytest.mark.slow
def test_batch_size_auto_gives_the_pipeline_with_a_slowed_stage_less(one_process, tmp_path):
    # 2 pipelines of 2 stages; rank 1 (stage 0 of pipeline 1, the CNN's convolutions) computes 12x slower. Each
    # rank times its own stage; a pipeline goes at its slowest stage's pace: pipeline 1 gets the smaller share,
    # in whole sets of 4 micro-batches, and the run still equals one process on the global batch of 16. (At 6x the
    # convolutions, about a quarter of the other stage's time, made pipeline 1 only ~1.65x slower, next to the
    # 1.67 that a share of 12 of 16 needs: a clean CI run measured [513, 310] samples/s and split [8, 8].)
    assert train(tmp_path, "auto", 4, {"simulate_slowdown": [1, 12, 1, 1]}, global_batch_size=16) == 0
    with open(tmp_path / "logs" / "rank0.log") as f:
        sizes = json.loads(re.search(r"per-pipeline batches (\[[\d, ]+\])", f.read()).group(1))
    assert sum(sizes) == 16 and all(b % 4 == 0 for b in sizes) and sizes[1] < sizes[0], sizes
    assert meta(tmp_path, STEPS)["batch_sizes"] == sizes
    assert_close(params(tmp_path, STEPS), params(one_process, STEPS), TOL)


@pytest.mark.parametrize("precision", ["fp16", slow("bf16")])  # quick: fp16, whose scaler every stage must follow
def test_mixed_precision_under_pipe(one_process, tmp_path, precision):
    # fp16: only the last stage scales a loss, yet every rank's scaler must unscale (and agree on skipping).
    assert train(tmp_path, 16, 2, precision=precision) == 0
    ours, ref = logged(tmp_path, "loss"), logged(one_process, "loss")
    assert len(ours) == len(ref) == STEPS
    assert all(abs(a - b) < 0.02 for a, b in zip(ours, ref)), (ours, ref)
    assert_close(params(tmp_path, STEPS), params(one_process, STEPS), 2e-3)


def test_resume_is_exact_and_test_mode_reads_a_pipe_checkpoint(pipe_run, tmp_path):
    import shutil
    full, cut = tmp_path / "full", tmp_path / "cut"
    shutil.copytree(pipe_run, full)  # a copy: test mode below writes its results into the run's folder
    # Resume from the middle: the same checkpoint, continued under the same layout, ends where the full run did.
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step-{STEPS}")
    assert train(cut, 16, 2, resume="auto") == 0
    with open(cut / "logs" / "rank0.log") as f:
        assert f"resumed from {cut}/checkpoints/step-{SAVE_AT}" in f.read()
    assert_close(params(cut, STEPS), params(full, STEPS), 0.0)
    # Stages wrote their own tensors under whole-model names: one CPU process evaluates the checkpoint.
    from main import run
    cfg = make_config(full, mode="test", model=MODEL, dist={"strategy": "none"},
                      test={"checkpoint": str(full / "checkpoints" / f"step-{STEPS}")})
    assert run(cfg) == 0
    with open(full / "dev_results.json") as f:
        dev = json.load(f)["metrics"]
    assert dev["accuracy"] == meta(full, STEPS)["metrics"]["accuracy"]
    assert abs(dev["loss"] - meta(full, STEPS)["metrics"]["loss"]) < 1e-5


def test_checkpoints_carry_over_between_pipe_and_replicated_strategies(one_process, pipe_run, tmp_path):
    """One process's checkpoint (model.pt; optimizer.pt indexed in parameter order) resumes under pipe, each
    stage taking its tensors and their SGD momentum by name; a pipe checkpoint (the stages' DCP shards) resumes in
    one process. Both end where one uninterrupted process does (momentum lost would show: ~1e-4)."""
    import shutil
    for source, target, procs in [(one_process, "to_pipe", 2), (pipe_run, "from_pipe", 1)]:
        out = tmp_path / target
        shutil.copytree(source, out)
        shutil.rmtree(out / "checkpoints" / f"step-{STEPS}")
        assert train(out, 16, procs, resume="auto") == 0
        with open(out / "logs" / "rank0.log") as f:
            assert f"resumed from {out}/checkpoints/step-{SAVE_AT}" in f.read()
        assert meta(out, STEPS)["format"] == ("sharded-pipe" if procs > 1 else "full")
        assert_close(params(out, STEPS), params(one_process, STEPS), TOL)


@pytest.mark.slow  # quick loop: the carry-over between pipe and one process, and test_sharded's full <-> fsdp
@pytest.mark.parametrize("direction", ["pipe_to_fsdp", "fsdp_to_pipe"])
def test_checkpoints_carry_over_between_pipe_and_fsdp(one_process, pipe_run, tmp_path, direction):
    """Both write DCP folders keyed by whole-model names: fsdp (2 ranks, each resharding every tensor) resumes
    pipe's step 3, and 2 stages resume the step 3 of an fsdp run. Both end where one process does."""
    import shutil
    if direction == "pipe_to_fsdp":
        source, target, dist = pipe_run, tmp_path / "fsdp", {"strategy": "fsdp"}
    else:
        source, target, dist = tmp_path / "fsdp", tmp_path / "pipe", None
        assert train(source, 8, 2, {"strategy": "fsdp"}) == 0
        assert meta(source, SAVE_AT)["format"] == "sharded-dcp"
    step = f"step-{SAVE_AT}"
    shutil.copytree(source / "checkpoints" / step, target / "checkpoints" / step)
    assert train(target, 8 if dist else 16, 2, dist, resume="auto") == 0  # 16 a step either way
    with open(target / "logs" / "rank0.log") as f:
        assert f"resumed from {target}/checkpoints/{step}" in f.read()
    assert meta(target, STEPS)["format"] == ("sharded-dcp" if dist else "sharded-pipe")
    assert_close(params(target, STEPS), params(one_process, STEPS), TOL)


def _device_moves_rank(local_rank, cfg, out_dir):
    """Builds a pipe Trainer while counting the parameter elements that go through Tensor.to (a move to the
    device): only this rank's stage may go there, never the whole model."""
    from core import distributed, process_group
    from wiring import build_task
    from wiring import build_trainer
    torch.set_num_threads(1)
    moved, original = [], torch.Tensor.to

    def spy(self, *args, **kwargs):
        if isinstance(self, torch.nn.Parameter) and self.numel():
            moved.append(self.numel())
        return original(self, *args, **kwargs)
    ctx = process_group.init(cfg, local_rank, 2, local_rank)
    try:
        torch.Tensor.to = spy
        try:
            task = build_task(cfg)
            trainer = build_trainer(cfg, ctx, task)
        finally:
            torch.Tensor.to = original
        held = sum(p.numel() for p in trainer.strategy.raw_model.parameters())
        whole = sum(p.numel() for p in task.build_model().parameters())
        torch.save({"moved": sum(moved), "held": held, "whole": whole, "planned": trainer.strategy.stage_params},
                   os.path.join(out_dir, f"{local_rank}.pt"))
        distributed.barrier(ctx)  # as wiring.worker: rank 0 holds the store; the other may still make its groups
    finally:
        distributed.shutdown(ctx)
    from core import process_end
    process_end.end_process(0)  # as main.py's ranks end (see there)


def test_only_a_ranks_own_stage_goes_to_its_device(tmp_path):
    cfg = make_config(tmp_path, model=MODEL, train={**TRAIN, "batch_size": 16},
                      dist={"strategy": "pipe", "procs_per_node": 2})
    spawn(_device_moves_rank, args=(cfg, str(tmp_path)), nprocs=2)
    counts = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert sum(c["held"] for c in counts) == counts[0]["whole"]  # the stages make up the model
    for rank, c in enumerate(counts):
        assert 0 < c["moved"] <= c["held"] < c["whole"], counts
        assert c["planned"][rank] == c["held"]  # what the plan prints per stage


@pytest.mark.slow  # quick loop: test_sharded's fsdp refusal of the same format (resume.load, for every strategy)
def test_a_checkpoint_pipe_cannot_read_is_one_line(tmp_path, capfd):
    assert train(tmp_path, 16, 1, max_steps=1, save_every=1, eval_every=0) == 0
    path = tmp_path / "checkpoints" / "step-1"
    saved = meta(tmp_path, 1)
    saved.update(strategy="fsdp", format="sharded-fairscale")  # as fairscale's FSDP (CUDA only) writes it
    (path / "meta.json").write_text(json.dumps(saved))
    assert train(tmp_path, 16, 2, max_steps=2, resume=str(path)) == 2
    out = "".join(capfd.readouterr())
    assert re.search(r"step-1: written by strategy fsdp in format sharded-fairscale, cannot resume under pipe "
                     r"\(it reads sharded-pipe, full or sharded-dcp\)", out), out


@pytest.mark.slow
def test_gpt2_tied_embeddings_bert_and_bart_chains_match_one_process(tmp_path):
    """GPT-2's LM head is its token embedding: a copy on each end of the pipeline, gradients added up. BERT's
    chain carries the attention mask between stages; pipe keeps the shards' full length (no column cut). BART
    (sst2's default) carries the encoder output through the decoder stages, and its shared embedding is tied
    between the encoder's first stage and the decoder's."""
    from test_text_tasks import sample, make_bert_shards
    import random
    rng = random.Random(0)
    gpt2 = sample.write_gpt2(str(tmp_path / "gpt2"), rng)
    sst2 = sample.write_sst2(str(tmp_path / "sst2"), rng)
    text = sample.write_bert_text(str(tmp_path / "bert.txt"), rng, documents=40)
    assert make_bert_shards.main(["--input", text, "--output-dir", str(tmp_path / "bert"), "--seq-length", "32",
                                  "--max-predictions", "5", "--shards", "2"]) == 0
    from main import run
    # Accumulation over 2 batches: the tied copies' gradients are added once per optimizer step, not per batch.
    common = {"max_steps": 3, "save_every": 3, "eval_every": 3, "batch_size": 8, "optimizer": "sgd", "lr": 0.05,
              "clip_grad_norm": 1.0, "log_every": 1, "grad_accum_steps": 2}
    for task, data in [("gpt2_lm", {"data_dir": gpt2, "max_length": 16}),
                       ("bert_pretrain", {"data_dir": str(tmp_path / "bert")}),
                       ("sst2", {"data_dir": sst2, "max_length": 32})]:
        runs = {}
        for name, section in [("one", {"strategy": "none"}),
                              ("pipe", {"strategy": "pipe", "procs_per_node": 2, "pp_schedule": "gpipe"})]:
            out = tmp_path / f"{task}-{name}"
            cfg = make_config(out, task=task, data=data, model={"name": "tiny", "dropout": 0.0}, train=common,
                              dist=section)
            assert run(cfg) == 0
            runs[name] = out
        a, b = params(runs["one"], 3), params(runs["pipe"], 3)
        assert_close(a, b, TOL)
        if task == "gpt2_lm":  # both copies of the tied weight took the same updates
            assert torch.equal(b["lm_head.weight"], b["transformer.wte.weight"])
        if task == "sst2":
            assert torch.equal(b["model.shared.weight"], b["model.decoder.embed_tokens.weight"])
            # sst2 pads to max_length under pipe, one process per batch: the same dev loss and accuracy
            dev = [dev_metrics(runs[name]) for name in ("one", "pipe")]
            assert abs(dev[0]["loss"] - dev[1]["loss"]) < 1e-5 and dev[0]["accuracy"] == dev[1]["accuracy"], dev


LM_MODEL = {"name": "tiny", "layers": 2, "heads": 4, "width": 32, "dropout": 0.0}
LM_TRAIN = {"max_steps": 4, "save_every": 2, "eval_every": 2, "keep_last": 5, "batch_size": 8, "optimizer": "sgd",
            "lr": 0.05, "clip_grad_norm": 0.5, "log_every": 1, "grad_accum_steps": 2}  # norms ~1.3-2.2: clipped


def lm_run(out, text, dist, arch="llama", model=None, **train) -> int:
    from main import run
    return run(make_config(out, task="gpt2_lm", data={"data_dir": text, "max_length": 16},
                           model={**LM_MODEL, "arch": arch, **(model or {})}, train={**LM_TRAIN, **train}, dist=dist))


@pytest.fixture(scope="module")
def lm_ref(tmp_path_factory):
    """The causal LM's one-process reference for a model.arch and train.precision (run on first use): batch 16 a
    step (2 x 8)."""
    from test_text_tasks import sample
    import random
    root = tmp_path_factory.mktemp("lm")
    text = sample.write_gpt2(str(root / "text"), random.Random(0))
    done = {}

    def one(arch, precision="fp32"):
        if (arch, precision) not in done:
            out = root / f"{arch}-{precision}"
            assert lm_run(out, text, {"strategy": "none"}, arch, precision=precision) == 0
            done[arch, precision] = out
        return text, done[arch, precision]
    return one


def assert_same_lm_run(out, one, step=4, tol=TOL):
    assert_close(params(out, step), params(one, step), tol)
    ours, ref = meta(out, step)["metrics"]["loss"], meta(one, step)["metrics"]["loss"]
    assert abs(ours - ref) <= 1e-4 * ref


PIPE_TP = {"strategy": "pipe", "procs_per_node": 4, "tp": 2}  # 2 stages x tp 2


@pytest.mark.slow
@pytest.mark.parametrize("arch, split, resumed_by", [("llama", "down_proj", [{"strategy": "none"}, PIPE_TP]),
                                                     ("gpt2", "c_proj", [PIPE_TP])])
def test_pipe_times_tp_ends_where_one_process_does(lm_ref, tmp_path, arch, split, resumed_by):
    """2 stages x tp 2 (4 ranks, one pipeline) on one ("pp", "dp", "tp") mesh: each stage's blocks split over its
    tp group, activations sent between ranks of equal tp index, the tied embedding's copies summed, clipping
    counting each piece once. Llama, and GPT-2 whose q|k|v are split in strides. Ends where one process does; its
    checkpoint (the stages' tp pieces) is read by test mode in one process, and resumed by one process (Llama) and
    by pipe x tp itself (GPT-2: the strided split read back; Llama: its optimizer's empty group, for tp-split
    vectors, keeps its hyperparameters)."""
    from core.checkpoint_dcp import read_dcp_metadata
    text, one = lm_ref(arch)
    out = tmp_path / "pipe_tp"
    assert lm_run(out, text, PIPE_TP, arch) == 0
    log = (out / "logs" / "rank0.log").read_text()
    assert "mesh pp 2 x dp 1 x tp 2 (rank = (stage x 1 + pipeline) x 2 + tp); ranks (stage,pipeline,tp): " \
           "0=(0,0,0), 1=(0,0,1), 2=(1,0,0), 3=(1,0,1)" in log and "stage 0 on ranks 0-1, stage 1 on ranks 2-3" in log
    assert_same_lm_run(out, one)
    assert logged(out, "loss") == logged(one, "loss")  # one rank of the last stage's tp group reports
    saved = read_dcp_metadata(str(out / "checkpoints" / "step-4" / "model_dcp")).state_dict_metadata
    assert [len(saved[k].chunks) for k in saved if k.endswith(f"1.mlp.{split}.weight")] == [2]  # in tp pieces
    from main import run
    cfg = make_config(out, mode="test", task="gpt2_lm", data={"data_dir": text, "max_length": 16},
                      model={**LM_MODEL, "arch": arch}, dist={"strategy": "none"})
    assert run(cfg) == 0
    with open(out / "dev_results.json") as f:
        assert abs(json.load(f)["metrics"]["loss"] - meta(out, 4)["metrics"]["loss"]) < 1e-6
    import shutil
    for i, layout in enumerate(resumed_by):
        resumed = tmp_path / f"resumed{i}"
        shutil.copytree(out / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
        assert lm_run(resumed, text, layout, arch, resume="auto") == 0
        assert_same_lm_run(resumed, one)


@pytest.mark.slow
@pytest.mark.parametrize("precision, schedule, tol", [("fp16", "1f1b", 5e-5), ("fp32", "interleaved_1f1b", TOL)])
def test_pipe_times_tp_fp16_and_interleaved_end_where_one_process_does(lm_ref, tmp_path, precision, schedule, tol):
    """2 stages x tp 2 (Llama) in fp16 (every rank's loss scaler unscales its own tp pieces:
    strategies/fp16.sharded_scaler) ends where one fp16 process does; the interleaved schedule (two one-layer
    stages per rank: the embeddings and block 1 on stage 0's tp group, block 0 and the head on stage 1's) ends where
    one process does. fp16's tolerance: the order of half-precision sums differs (seen 3e-6 to 1.2e-5)."""
    text, one = lm_ref("llama", precision)
    assert lm_run(tmp_path, text, {**PIPE_TP, "pp_schedule": schedule}, precision=precision) == 0
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "mesh pp 2 x dp 1 x tp 2" in log and f"schedule {schedule}," in log
    assert_same_lm_run(tmp_path, one, tol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("pp_dp", ["ddp", "fsdp"])
def test_pipe_times_tp_replicas_resume_one_process_and_end_where_it_does(lm_ref, tmp_path, pp_dp):
    """The "dp" dimension with tp on 4 ranks: 1 stage x 2 pipelines x tp 2, the replicas averaged by hand (DDP
    cannot hold DTensors) or sharded by FSDP2 over "dp" (2-D with the tp split). Started from one process's
    step 2 (Llama): each rank cuts its tp piece (and fsdp shard) of every tensor and of its momentum."""
    import shutil
    text, one = lm_ref("llama")
    shutil.copytree(one / "checkpoints" / "step-2", tmp_path / "checkpoints" / "step-2")
    layout = {**PIPE_TP, "pp_stages": 1, "pp_dp": pp_dp}
    assert lm_run(tmp_path, text, layout, batch_size=4, resume="auto") == 0
    assert "mesh pp 1 x dp 2 x tp 2" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_lm_run(tmp_path, one)


@pytest.mark.slow
@pytest.mark.parametrize("arch, split", [("llama", {"sequence_parallel": True}), ("gpt2", {"sequence_parallel": True}),
                                         ("llama", {"sequence_parallel": True, "loss_parallel": True})])
def test_pipe_times_tp_sequence_and_loss_parallel_end_where_one_process_does(lm_ref, tmp_path, arch, split):
    """2 stages x tp 2 with sequence parallelism: the second stage receives each rank's half of the positions (a
    Llama block builds its rotary positions and causal mask for all of them), and the norms' gradients are summed
    over the tp group. With loss parallelism (an untied head: its own one-process reference) the schedule runs
    under loss_parallel() and the logits stay split by vocabulary. Each ends where one process does."""
    text, one = lm_ref(arch)
    untied = {"tie_embeddings": False} if split.get("loss_parallel") else {}
    if untied:
        one = tmp_path / "one"
        assert lm_run(one, text, {"strategy": "none"}, arch, model=untied) == 0
    out = tmp_path / "pipe_tp"
    assert lm_run(out, text, {**PIPE_TP, **split}, arch, model=untied) == 0
    line = next(x for x in (out / "logs" / "rank0.log").read_text().splitlines() if "  tp with " in x)
    assert all(key.replace("_", " ") in line for key in split), line
    assert_same_lm_run(out, one)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"procs_per_node": 4}, {"procs_per_node": 8, "tp": 2, "sequence_parallel": True}])
def test_pipe_fsdp_replicas_sum_the_tied_embeddings_copies(lm_ref, tmp_path, layout):
    """2 stages x 2 pipelines, pp_dp fsdp, GPT-2: its token embedding is also its head, so the first and the last
    stage hold a copy each, sharded alike over the stage's replicas; the copies' gradients are summed shard by
    shard (an all-reduce of the DTensor itself has no sharding rule). Ends where one process does, and with tp 2
    and sequence parallelism too (8 ranks: pp 2 x dp 2 x tp 2)."""
    text, one = lm_ref("gpt2")
    assert lm_run(tmp_path, text, {"strategy": "pipe", "pp_dp": "fsdp", **layout}, "gpt2", batch_size=4) == 0
    assert_same_lm_run(tmp_path, one)



@pytest.fixture(scope="module")
def lm_ema_ref(lm_ref, tmp_path_factory):
    """GPT-2 in one process with train.ema_decay: its weights and their average (ema.pt)."""
    text, _ = lm_ref("gpt2")
    out = tmp_path_factory.mktemp("gpt2-ema")
    assert lm_run(out, text, {"strategy": "none"}, "gpt2", ema_decay=0.5) == 0
    return text, out


@pytest.mark.slow
@pytest.mark.parametrize("pp_dp", ["ddp", "fsdp"])
def test_tied_embeddings_copies_on_one_rank_train_and_average_like_one_process(lm_ema_ref, tmp_path, pp_dp):
    """pp_stages 1, interleaved: GPT-2's embedding (stage 0) and head (stage 1) on one rank, 2 pipelines. Under
    pp_dp fsdp each stage's copy of the tied weight is its own object: the copies' gradients must be added up on
    the rank (they drifted apart, each taking half the gradient) and counted once in the clipping norm; under ddp,
    two DDP-wrapped stages holding one parameter crashed in backward. Weights and average end where one process's
    do, and both copies stay one weight."""
    text, one = lm_ema_ref
    assert lm_run(tmp_path, text, {"strategy": "pipe", "procs_per_node": 2, "pp_stages": 1, "pp_dp": pp_dp,
                                   "pp_schedule": "interleaved_1f1b"}, "gpt2", batch_size=4, ema_decay=0.5) == 0
    assert_same_lm_run(tmp_path, one)
    ours = params(tmp_path, 4)
    assert torch.equal(ours["lm_head.weight"], ours["transformer.wte.weight"])
    ema = [torch.load(out / "checkpoints" / "step-4" / "ema.pt", weights_only=True) for out in (tmp_path, one)]
    assert_close(ema[0], ema[1], TOL)
    ours, ref = meta(tmp_path, 4)["metrics"]["ema_loss"], meta(one, 4)["metrics"]["ema_loss"]
    assert abs(ours - ref) <= 1e-5 * ref  # evaluated with the average in both copies (fsdp: in one, 3e-4 off)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["none", "fsdp"])
def test_pipe_fsdp_replicas_resume_the_tied_embeddings_copies_momentum(lm_ref, tmp_path, source):
    """GPT-2 under pp_dp fsdp from a step-2 checkpoint of one process (model.pt, optimizer.pt) or of fsdp (DCP):
    the last stage's copy of the tied embedding (its own object, named lm_head.weight there) reads the momentum
    saved under transformer.wte.weight, and the run ends where one process does."""
    import shutil
    text, one = lm_ref("gpt2")
    if source == "fsdp":
        assert lm_run(tmp_path, text, {"strategy": "fsdp", "procs_per_node": 2}, "gpt2", batch_size=4) == 0
        shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    else:
        shutil.copytree(one / "checkpoints" / "step-2", tmp_path / "checkpoints" / "step-2")
    assert lm_run(tmp_path, text, {"strategy": "pipe", "pp_dp": "fsdp", "procs_per_node": 4}, "gpt2",
                  batch_size=4) == 0
    assert "resumed from" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_lm_run(tmp_path, one)

@pytest.mark.slow
def test_pipe_times_tp_batch_size_auto_gives_the_pipeline_with_a_slowed_rank_less(lm_ref, tmp_path):
    """1 stage x 2 pipelines x tp 2, rank 2 (in pipeline 1's tp group) simulated 6x slower: each tp group times its
    stage together, so pipeline 1 gets the smaller share, in whole sets of 2 micro-batches; the run with those
    uneven sizes ends where one process does."""
    text, one = lm_ref("llama")
    layout = {**PIPE_TP, "pp_stages": 1, "pp_microbatches": 2, "simulate_slowdown": [1, 1, 6, 1]}
    assert lm_run(tmp_path, text, layout, batch_size="auto", global_batch_size=8) == 0
    sizes = meta(tmp_path, 4)["batch_sizes"]
    assert sum(sizes) == 8 and all(b % 2 == 0 for b in sizes) and sizes[1] < sizes[0], sizes  # ideally [6, 2]
    assert f"-> per-pipeline batches {sizes}" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_lm_run(tmp_path, one)


def dev_metrics(output_dir) -> dict:
    """The last `step N dev: k=v ...` line of rank 0's log."""
    lines = [line for line in open(os.path.join(output_dir, "logs", "rank0.log")) if " dev: " in line]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.e+]+)", lines[-1].split(" dev: ", 1)[1])}


# ---- auto split, shapes, config ------------------------------------------------------------------------------
def test_min_max_partition_balances_the_slowest_stage():
    from strategies.pipeline import min_max_partition
    assert min_max_partition([[1.0] * 8, [1.0] * 8]) == [4, 4]
    assert min_max_partition([[1.0] * 8, [3.0] * 8]) == [6, 2]  # stage 1 is 3x slower: a quarter of the work
    assert min_max_partition([[5, 1, 1, 1], [5, 1, 1, 1]]) == [1, 3]  # one heavy layer alone
    assert sum(min_max_partition([[1.0] * 5] * 3)) == 5


def _auto_split_rank(rank, port, out):
    import torch.distributed as dist
    from strategies.pipeline import auto_split
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)]
    cfg = types.SimpleNamespace(dist=types.SimpleNamespace(simulate_slowdown=[1, 3]))
    ctx = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    sizes = auto_split(layers, (torch.randn(32, 64),), 2, cfg, ctx)
    torch.save(sizes, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_auto_split_gives_the_slowed_stage_fewer_layers(tmp_path):
    # 8 equal layers, rank 1 simulated 3x slower: its stage should get about a quarter of them (2).
    spawn(_auto_split_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    sizes = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert sizes[0] == sizes[1]  # every rank decides the same split
    assert sum(sizes[0]) == 8 and sizes[0][1] < sizes[0][0] and sizes[0][1] <= 3, sizes


def test_a_shape_change_is_one_line_naming_the_cause():
    from core.errors import DataError
    from strategies.pipeline import PipeStrategy
    fake = types.SimpleNamespace(first_shapes=None)
    PipeStrategy.check_shapes(fake, {"input_ids": torch.zeros(8, 32), "labels": torch.zeros(8)})
    PipeStrategy.check_shapes(fake, {"input_ids": torch.zeros(8, 32), "labels": torch.zeros(8)})
    with pytest.raises(DataError) as e:
        PipeStrategy.check_shapes(fake, {"input_ids": torch.zeros(8, 20), "labels": torch.zeros(8)})
    assert "input_ids (8, 32) -> (8, 20)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dist_section, train_section, key", [
    ({"pp_stages": 3}, {}, "dist.pp_stages"),                        # 4 ranks do not make pipelines of 3
    ({}, {"batch_size": 10}, "train.batch_size"),                     # 10 does not cut into 4 micro-batches
    ({}, {"batch_size": [8, 8, 8]}, "train.batch_size"),              # 2 pipelines, 3 sizes
    ({}, {"batch_size": "auto", "global_batch_size": 10}, "train.global_batch_size"),  # not 4-micro-batch sets
    ({"pp_dp": "fsdp"}, {"batch_size": "auto", "global_batch_size": 16}, "train.batch_size"),  # lockstep replicas
    ({"pp_split": [1, 1, 1]}, {}, "dist.pp_split"),                   # 2 stages, 3 counts
    ({"pp_schedule": "interleaved_1f1b", "pp_microbatches": 3}, {"batch_size": 9}, "dist.pp_microbatches"),
    ({"pp_stages": 4, "pp_microbatches": 2}, {}, "dist.pp_microbatches"),  # 1f1b needs one per stage at least
    ({"tp": 2, "pp_stages": 4}, {}, "dist.pp_stages"),                # 4 ranks are not 4 stages x tp 2
    ({"pp_schedule": "zero_bubble", "pp_dp": "fsdp"}, {}, "dist.pp_schedule"),  # ended 3e-3 off one process
])
def test_pipe_config_mistakes_are_one_line(tmp_path, dist_section, train_section, key):
    from core.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, dist={"strategy": "pipe", "procs_per_node": 4, **dist_section},
                    train={"batch_size": 8, **train_section})
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_model_sst2_cannot_split_is_one_line():
    from core.errors import DataError
    from tasks.sst2 import SST2Task
    with pytest.raises(DataError, match="sst2 splits BART and BERT-style classifiers; Linear is not split yet"):
        SST2Task.pipeline_layers(None, torch.nn.Linear(2, 2))



@pytest.mark.parametrize("task_name", ["image", slow("sst2")])
def test_a_chain_in_eval_mode_draws_no_dropout(tmp_path, task_name):
    # pipe evaluates its stages in eval mode, but the digits CNN's dropout modules and BART's embedding dropout
    # (which read its encoder's mode) were outside every stage: pipe's dev metrics were taken with dropout on.
    from test_text_tasks import sample
    import random
    from wiring import build_task
    data, model = {}, {}
    if task_name == "sst2":  # BART, sst2's default
        data, model = {"data_dir": sample.write_sst2(str(tmp_path / "sst2"), random.Random(0)), "max_length": 32}, \
            {"name": "tiny"}
    task = build_task(make_config(tmp_path, task=task_name, data=data, model={**model, "dropout": 0.5}))
    dev = task.build_datasets()["dev"]
    batch = task.collate([dev[i] for i in range(8)])
    whole = task.build_model().train()  # as pipe keeps the whole model; its stages alone change mode
    chain = torch.nn.ModuleList(task.pipeline_layers(whole)).eval()

    def run_chain():
        carry = task.pipeline_inputs(batch)
        with torch.no_grad():
            for layer in chain:
                carry = layer(*carry)
                carry = carry if isinstance(carry, tuple) else (carry,)
        return carry[0]
    ours = run_chain()
    whole.eval()
    assert torch.equal(ours, run_chain())
