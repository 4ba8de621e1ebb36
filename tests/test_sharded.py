"""Sharded strategies (oss, fsdp) on 2 gloo processes on CPU: same result as one process, less state per rank,
exact resume, sharded checkpoints readable by test mode and by another world size."""
import json
import os

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fairscale_cpu
from conftest import free_port, logged, make_config, slow, spawn

STEPS, SAVE_AT = 6, 3
# Two ranks with 16 samples each see exactly the samples of one process with 32 (GlobalBatchSampler). With
# accumulation (no_sync), clipping on every step (the global norm is 0.35-0.46) and no dropout, only the order of
# floating point sums differs between the runs. SGD, not Adam: its update is proportional to the gradient, so a
# wrong clipping factor shows (Adam's normalisation would mostly hide it).
TRAIN = {"max_steps": STEPS, "save_every": SAVE_AT, "eval_every": 0, "keep_last": 5, "grad_accum_steps": 2,
         "clip_grad_norm": 0.1, "optimizer": "sgd", "lr": 0.05, "log_every": 1, "eval_batch_size": 64}
MODEL = {"dropout": 0.0}
TOL = 1e-5  # measured: the sharded runs agree with one process to ~1e-8; parameters move ~1e-3 in 3 steps

SHARDED = {
    "oss": {"strategy": "oss"},
    "oss-torch": {"strategy": "oss", "oss_impl": "torch"},
    "oss-shard-grads": {"strategy": "oss", "shard_grads": True},
    "fsdp": {"strategy": "fsdp"},
}


def train(output_dir, dist_section, batch_size, procs, **train):
    from main import run
    cfg = make_config(output_dir, model=MODEL, train={**TRAIN, "batch_size": batch_size, **train},
                      dist={**dist_section, "procs_per_node": procs})
    return run(cfg)


def train_fairscale_fsdp(output_dir, batch_size, procs, **train):
    """fsdp_impl: fairscale on CPU, through the test-only shim (tests/fairscale_cpu.py)."""
    cfg = make_config(output_dir, model=MODEL, train={**TRAIN, "batch_size": batch_size, **train},
                      dist={"strategy": "fsdp", "procs_per_node": procs})
    return fairscale_cpu.train(cfg, procs)


def params(output_dir, step):
    from core.checkpoint_io import model_state_dict
    return model_state_dict(os.path.join(output_dir, "checkpoints", f"step-{step}"))


def assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=atol), f"{k}: max diff {(a[k] - b[k]).abs().max():.3g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Output directories of finished runs, each trained once per module: 'none' and the SHARDED ones."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            if name == "none":
                assert train(out, {"strategy": "none"}, 32, 1) == 0
            elif name == "fairscale-fsdp":
                assert train_fairscale_fsdp(out, 16, 2) == 0
            else:
                assert train(out, SHARDED[name], 16, 2) == 0
            done[name] = out
        return done[name]
    return get


# quick loop: oss and fsdp; the memory test below runs a step of oss-torch and oss-shard-grads
@pytest.mark.parametrize("name", ["oss", slow("oss-torch"), slow("oss-shard-grads"), "fsdp"])
def test_sharded_training_matches_one_process(runs, name):
    assert_close(params(runs(name), STEPS), params(runs("none"), STEPS), TOL)
    norms = logged(runs(name), "grad_norm")
    assert len(norms) == STEPS and norms == pytest.approx(logged(runs("none"), "grad_norm"), rel=1e-3)
    meta = json.loads((runs(name) / "checkpoints" / f"step-{STEPS}" / "meta.json").read_text())
    assert meta["format"] == ("sharded-dcp" if name == "fsdp" else "full")


@pytest.mark.slow  # quick loop: test_hetero's uneven batches under ddp (the same loss scaling)
@pytest.mark.parametrize("name", ["fsdp", "oss", "oss-torch", "oss-shard-grads", "fairscale-fsdp"])
def test_uneven_batches_under_sharding_match_one_process(runs, tmp_path, name):
    """A fast and a slow device with batches [24, 8]: the sharded strategies weight the gradients exactly too
    (their reductions average over ranks; the loss is scaled by world / global count, as under DDP)."""
    if name == "fairscale-fsdp":
        assert train_fairscale_fsdp(tmp_path, [24, 8], 2) == 0
    else:
        assert train(tmp_path, SHARDED[name], [24, 8], 2) == 0
    assert_close(params(tmp_path, STEPS), params(runs("none"), STEPS), TOL)


@pytest.mark.slow  # quick loop: test_foundation's early stopping in one process
@pytest.mark.parametrize("name", ["fsdp", "oss-shard-grads", "fairscale-fsdp"])
def test_early_stopping_under_sharding(tmp_path, name):
    """Every rank reaches the same stop decision (it is made from the gathered dev metrics): stopping at step
    15, after two evaluations without improvement, instead of hanging with one rank still in a collective."""
    from core.checkpoint import latest
    from core.checkpoint_meta import best_recorded as best, read as read_meta
    stop = {"max_steps": 100, "eval_every": 5, "save_every": 0, "patience": 2, "lr": 1e-12, "schedule": "constant"}
    if name == "fairscale-fsdp":
        assert train_fairscale_fsdp(tmp_path, 16, 2, **stop) == 0
    else:
        assert train(tmp_path, SHARDED[name], 16, 2, **stop) == 0
    meta = read_meta(latest(str(tmp_path)))
    assert meta["step"] == 15 and meta["state"]["best_step"] == 5 and best(str(tmp_path)).endswith("step-5")


@pytest.mark.parametrize("name, precision", [  # quick loop: ShardedGradScaler (fsdp); GradScaler: test_foundation
    (n, p) if (n, p) == ("fsdp", "fp16") else slow(n, p) for n in SHARDED for p in ["fp16", "bf16"]])
def test_mixed_precision_under_sharding(runs, tmp_path, name, precision):
    """fp16 autocast with loss scaling (ShardedGradScaler where ranks hold different gradients: fsdp, oss +
    shard_grads; else GradScaler, whose inf check sees the whole all-reduced gradient), or bf16 without: trains
    like fp32 up to rounding, parameters stay fp32, and the scaler state (fp16) is checkpointed."""
    assert train(tmp_path, SHARDED[name], 16, 2, precision=precision) == 0
    assert logged(tmp_path, "grad_norm") == pytest.approx(logged(runs("none"), "grad_norm"), rel=1e-2)
    assert_close(params(tmp_path, STEPS), params(runs("none"), STEPS), 1e-3)
    state = torch.load(tmp_path / "checkpoints" / f"step-{STEPS}" / "state.pt", weights_only=True)
    assert (state["scaler"]["scale"] > 1) if precision == "fp16" else state["scaler"] is None


def test_fsdp_checkpoint_holds_shards_not_model_pt(runs):
    ckpt = runs("fsdp") / "checkpoints" / f"step-{STEPS}"
    assert not (ckpt / "model.pt").exists() and not (ckpt / "optimizer.pt").exists()
    for folder in ("model_dcp", "optimizer_dcp"):  # one file per rank: nothing was gathered to save
        assert sorted(p.name for p in (ckpt / folder).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_fsdp_resume_is_exact(runs, tmp_path):
    first = runs("fsdp")
    assert train(tmp_path, SHARDED["fsdp"], 16, 2, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    resumed, uninterrupted = params(tmp_path, STEPS), params(first, STEPS)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.slow  # quick loop: test_checkpoints_resume_across_strategies[fsdp-none], the same DCP folders in 1 process
def test_fsdp_resumes_on_one_process(runs, tmp_path):
    """2 -> 1 ranks: DCP reshards the model and optimizer state; one rank with 32 samples continues the run."""
    first = runs("fsdp")
    assert train(tmp_path, SHARDED["fsdp"], 32, 1, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    assert_close(params(tmp_path, STEPS), params(first, STEPS), TOL)


@pytest.mark.parametrize("source", ["fsdp", slow("none")])
def test_fsdp_checkpoint_of_another_model_is_a_one_line_error(runs, tmp_path, capfd, source):
    """Its own DCP folders or a full checkpoint (cut into shards by each rank), made for a wider model."""
    from main import run
    ckpt = runs(source) / "checkpoints" / f"step-{SAVE_AT}"
    cfg = make_config(tmp_path, model={**MODEL, "hidden": 64}, train={**TRAIN, "batch_size": 16, "resume": str(ckpt)},
                      dist={**SHARDED["fsdp"], "procs_per_node": 2})
    assert run(cfg) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all("does not fit this model" in e and "model.hidden=128 (now 64)" in e
                                    for e in errors), errors  # both ranks said it; printed once


@pytest.mark.slow  # quick loop: test_sharded_training_matches_one_process[oss] checks oss writes the full format
def test_oss_consolidated_checkpoint_resumes_on_one_process(runs, tmp_path):
    first = runs("oss-shard-grads")
    assert train(tmp_path, {"strategy": "oss"}, 32, 1, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    assert_close(params(tmp_path, STEPS), params(first, STEPS), TOL)


def test_fsdp_checkpoint_in_test_mode(runs, tmp_path):
    from main import run
    ckpt = runs("fsdp") / "checkpoints" / f"step-{STEPS}"
    cfg = make_config(tmp_path, mode="test", model=MODEL, test={"checkpoint": str(ckpt)},
                      dist={"strategy": "fsdp", "procs_per_node": 2})  # test mode runs in one process anyway
    assert run(cfg) == 0
    dev = json.loads((tmp_path / "dev_results.json").read_text())
    test = json.loads((tmp_path / "test_results.json").read_text())
    trained = json.loads((ckpt / "meta.json").read_text())["metrics"]  # dev metrics from the 2-rank run
    assert dev["metrics"]["samples"] == trained["samples"]
    assert dev["metrics"]["accuracy"] == pytest.approx(trained["accuracy"])
    assert dev["metrics"]["loss"] == pytest.approx(trained["loss"], rel=1e-5)
    assert test["metrics"]["samples"] > 0


def test_fsdp_refuses_a_fairscale_fsdp_checkpoint(runs, tmp_path, capsys):
    ckpt = runs("fairscale-fsdp") / "checkpoints" / f"step-{SAVE_AT}"
    assert train(tmp_path, SHARDED["fsdp"], 32, 1, resume=str(ckpt)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "format sharded-fairscale, cannot resume under fsdp" in errors[0], errors


# ---- memory: count the state each rank holds after one step ---------------------------------------------------
def _memory_worker(rank, port, queue):
    from core.distributed import DistContext
    from wiring import parallelize as apply
    from tests.rank_memory import state_bytes
    from wiring import build_task
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
    fairscale_cpu.install()  # changes nothing for the other strategies (there is no CUDA to call)
    for name, section in [("ddp", {"strategy": "ddp"}), *SHARDED.items(), ("fairscale-fsdp", {"strategy": "fsdp"})]:
        cfg = make_config("/tmp/unused", model=MODEL, dist={**section, "procs_per_node": 2})
        if name == "fairscale-fsdp":  # validate() refuses it on CPU, where only the shim makes it run
            cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fsdp_impl="fairscale"))
        task = build_task(cfg)
        train_set = task.build_datasets()["train"]
        torch.manual_seed(0)
        strategy = apply(task.build_model(), cfg, ctx, task, train_set)
        batch = task.collate([train_set[i] for i in range(8 * rank, 8 * rank + 8)])
        task.loss_sum(strategy.model, batch).backward()
        strategy.optimizer.step()
        queue.put((name, rank, state_bytes(strategy)))  # before zero_grad: parameters, gradients and state
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def memory():
    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_memory_worker, args=(free_port(), queue), nprocs=2)
    out = {}
    for _ in range(2 * (2 + len(SHARDED))):
        name, rank, counts = queue.get()
        out.setdefault(name, [None, None])[rank] = counts
    return out


@pytest.mark.parametrize("name", ["oss", "oss-torch", "oss-shard-grads"])
def test_oss_shards_optimizer_state(memory, name):
    ddp, ranks = memory["ddp"][0], memory[name]
    # Every parameter's state lives on exactly one rank. Whole tensors are assigned, so the split of this small
    # CNN is uneven (its largest matrix is 62% of it); it evens out for many similar tensors (bench: BERT).
    assert sum(r["optimizer"] for r in ranks) == ddp["optimizer"]
    assert all(r["optimizer"] <= 0.7 * ddp["optimizer"] for r in ranks)
    assert all(r["params"] == ddp["params"] for r in ranks)  # parameters stay replicated
    if name == "oss-shard-grads":  # a rank keeps only the gradients of the parameters it updates
        assert sum(r["grads"] for r in ranks) == ddp["grads"]
        assert all(r["grads"] <= 0.7 * ddp["grads"] for r in ranks)
    else:
        assert all(r["grads"] == ddp["grads"] for r in ranks)


@pytest.mark.parametrize("name", ["fsdp", "fairscale-fsdp"])
def test_fsdp_shards_all_model_state(memory, name):
    ddp = sum(memory["ddp"][0].values())
    for rank in memory[name]:
        assert 0.45 * ddp <= sum(rank.values()) <= 0.55 * ddp, (rank, ddp)
        assert rank["params"] <= 0.55 * memory["ddp"][0]["params"]


# ---- fairscale FSDP: CUDA only in the product; on CPU through the shim in tests/fairscale_cpu.py ----------------
def test_fairscale_fsdp_matches_one_process(runs):
    """Per-block wrapping, no_sync accumulation and fairscale's global-norm clipping give the one-process result;
    model.pt is gathered from the shards (so test mode and any world size read it), the optimizer stays sharded."""
    out = runs("fairscale-fsdp")
    assert_close(params(out, STEPS), params(runs("none"), STEPS), TOL)
    assert logged(out, "grad_norm") == pytest.approx(logged(runs("none"), "grad_norm"), rel=1e-3)
    ckpt = out / "checkpoints" / f"step-{STEPS}"
    assert json.loads((ckpt / "meta.json").read_text())["format"] == "sharded-fairscale"
    assert {"model.pt", "optimizer-rank0.pt", "optimizer-rank1.pt"} <= {p.name for p in ckpt.iterdir()}
    shards = [torch.load(ckpt / f"optimizer-rank{r}.pt", weights_only=True)["state"] for r in (0, 1)]
    momentum = [sum(s["momentum_buffer"].numel() for s in shard.values()) for shard in shards]
    n_params = sum(v.numel() for v in params(out, STEPS).values())
    assert all(0.45 * n_params <= m <= 0.55 * n_params for m in momentum), (momentum, n_params)


def test_fairscale_fsdp_resume_is_exact(runs, tmp_path):
    first = runs("fairscale-fsdp")
    assert train_fairscale_fsdp(tmp_path, 16, 2, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    resumed, uninterrupted = params(tmp_path, STEPS), params(first, STEPS)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.slow  # quick loop: test_fsdp_refuses_a_fairscale_fsdp_checkpoint, the other refusal of its format
def test_fairscale_fsdp_refuses_another_world_size(runs, tmp_path):
    """Its optimizer shards are fairscale's own format, one per rank: resuming on 1 process fails in one line."""
    ckpt = runs("fairscale-fsdp") / "checkpoints" / f"step-{SAVE_AT}"
    assert train_fairscale_fsdp(tmp_path, 32, 1, resume=str(ckpt)) == 2
    # (the rank's log has the line it printed)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1 and "written by 2 ranks" in errors[0] and "resume with 2 processes" in errors[0], log


def test_fairscale_fsdp_checkpoint_in_test_mode(runs, tmp_path):
    from main import run
    ckpt = runs("fairscale-fsdp") / "checkpoints" / f"step-{STEPS}"
    assert run(make_config(tmp_path, mode="test", model=MODEL, test={"checkpoint": str(ckpt)})) == 0
    dev = json.loads((tmp_path / "dev_results.json").read_text())
    trained = json.loads((ckpt / "meta.json").read_text())["metrics"]  # dev metrics from the 2-rank run
    assert dev["metrics"]["accuracy"] == pytest.approx(trained["accuracy"])
    assert dev["metrics"]["loss"] == pytest.approx(trained["loss"], rel=1e-5)


@pytest.mark.slow  # quick loop: fsdp x fp16 in test_mixed_precision_under_sharding
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fairscale_fsdp_mixed_precision(runs, tmp_path, precision):
    """fairscale's mixed_precision (low-precision compute copies of fp32 shards, fp32 reduce-scatter) under
    autocast; fp16 with the sharded grad scaler, whose state is checkpointed."""
    assert train_fairscale_fsdp(tmp_path, 16, 2, precision=precision) == 0
    assert logged(tmp_path, "grad_norm") == pytest.approx(logged(runs("none"), "grad_norm"), rel=1e-2)
    assert_close(params(tmp_path, STEPS), params(runs("none"), STEPS), 1e-3)  # parameters stay fp32
    state = torch.load(tmp_path / "checkpoints" / f"step-{STEPS}" / "state.pt", weights_only=True)
    assert (state["scaler"]["scale"] > 1) if precision == "fp16" else state["scaler"] is None


def test_impossible_combinations_are_one_line_config_errors(tmp_path):
    from core.errors import ConfigError
    with pytest.raises(ConfigError, match="shard_grads"):
        make_config(tmp_path, dist={"strategy": "ddp", "shard_grads": True})
    with pytest.raises(ConfigError, match="shard_grads"):
        make_config(tmp_path, dist={"strategy": "oss", "oss_impl": "torch", "shard_grads": True})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fsdp_impl.*CUDA") as e:
            make_config(tmp_path, dist={"strategy": "fsdp", "fsdp_impl": "fairscale"})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("source,target", [("none", "oss"), slow("oss", "ddp"), slow("oss-torch", "oss"),
                                           slow("oss-shard-grads", "none"), ("none", "fsdp"), ("fsdp", "none"),
                                           slow("fsdp", "ddp")])  # quick: full -> oss, full <-> fsdp
def test_checkpoints_resume_across_strategies(runs, tmp_path, source, target):
    """ddp, none and oss all write the `full` format (oss consolidates its optimizer state first), so a run may
    switch between them; fsdp cuts its shards out of a full checkpoint (each rank from the whole tensors), and
    its DCP folders are assembled by parameter name under the others. The resumed run ends where the
    uninterrupted one did, momentum included."""
    ckpt = runs(source) / "checkpoints" / f"step-{SAVE_AT}"
    procs = 1 if target == "none" else 2
    section = SHARDED.get(target, {"strategy": target})
    assert train(tmp_path, section, 32 // procs, procs, resume=str(ckpt)) == 0
    assert_close(params(tmp_path, STEPS), params(runs(source), STEPS), TOL)


def test_join_output_grads_runs_every_output_hook_before_any_parameter_gradient():
    """The forward hook apply_fsdp puts on the model under fairscale FSDP's root: values and gradients are
    unchanged, and the hooks fairscale puts on the outputs all run before any parameter's gradient is done
    (without it, the second head's gradient is done before the first output's hook: what crashed BERT)."""
    from transformers.utils import ModelOutput
    from strategies.fsdp import join_output_grads

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)

        def forward(self, x):
            return ModelOutput(first=self.a(x), second=self.b(x), extra=(x.sum(), "not a tensor"))

    def run(joined):
        torch.manual_seed(0)
        model = TwoHeads()
        if joined:
            model.register_forward_hook(join_output_grads)
        events = []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: events.append("grad " + name))
        out = model(torch.randn(5, 4, requires_grad=True))
        for key in ("first", "second"):
            out[key].register_hook(lambda g, key=key: events.append("output " + key))
        (out.first.sum() * 2 + out["second"].sum()).backward()
        assert out.extra[1] == "not a tensor" and isinstance(out, ModelOutput)
        return events, {n: p.grad for n, p in model.named_parameters()}, out

    (events, grads, out), (plain_events, plain_grads, plain_out) = run(True), run(False)
    assert torch.equal(out.first, plain_out.first) and torch.equal(out.second, plain_out.second)
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    outputs_done = max(i for i, e in enumerate(events) if e.startswith("output"))
    assert outputs_done < min(i for i, e in enumerate(events) if e.startswith("grad"))
    assert not max(i for i, e in enumerate(plain_events) if e.startswith("output")) < min(
        i for i, e in enumerate(plain_events) if e.startswith("grad"))  # the problem is real without it


def test_a_sharded_checkpoint_without_its_dcp_folders_is_one_line_under_fsdp_and_pipe(tmp_path):
    """fsdp and pipe read model_dcp/ and optimizer_dcp/ (or a replicated strategy's model.pt): a folder without
    them names the one missing and what each strategy resumes from, before anything of the model is touched."""
    from core.errors import CheckpointError
    from strategies.fsdp import FSDPStrategy
    from strategies.pipeline import PipeStrategy
    (tmp_path / "model_dcp").mkdir()
    (tmp_path / "model_dcp" / ".metadata").write_bytes(b"")
    for strategy, name, other in [(FSDPStrategy, "fsdp", "pipe"), (PipeStrategy, "pipe", "fsdp")]:
        with pytest.raises(CheckpointError) as e:
            strategy.load(None, str(tmp_path), {})
        assert str(e.value) == (f"{tmp_path}/optimizer_dcp: missing; {name} resumes from checkpoints that {name}, "
                                f"{other} or a replicated strategy wrote (test mode reads any checkpoint)")
