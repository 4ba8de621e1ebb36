"""The speed knobs: train.optimizer_impl (fused / foreach / for_loop), model.activation_checkpointing,
train.compile and train.profile_steps. Each gives the same training as without it (within a stated tolerance),
and the impossible combinations are one-line config errors."""
import glob
import json
import os

import pytest
import torch

from conftest import make_config, max_diff, slow

import main
from core.errors import ConfigError


def train(cfg):
    """Run cfg (main.run starts the ranks); the model of its last checkpoint, whatever the format (FSDP: DCP)."""
    from core.checkpoint_io import model_state_dict
    assert main.run(cfg) == 0
    return model_state_dict(os.path.join(cfg.output_dir, "checkpoints", f"step-{cfg.train.max_steps}"))


# ---- optimizer implementation ---------------------------------------------------------------------------------
def test_fused_foreach_and_for_loop_adamw_give_the_same_training(tmp_path):
    common = dict(model={"dropout": 0.0}, train={"max_steps": 6, "eval_every": 0, "save_every": 0, "lr": 3e-3,
                                                   "weight_decay": 0.01, "clip_grad_norm": 1.0})
    runs = {impl: train(make_config(tmp_path / impl, **{**common, "train": {**common["train"],
                                                                            "optimizer_impl": impl}}))
            for impl in ("fused", "foreach", "for_loop")}
    # Same update up to float rounding (the fused kernel orders its arithmetic differently).
    assert max_diff(runs["fused"], runs["for_loop"]) < 1e-5
    assert max_diff(runs["foreach"], runs["for_loop"]) < 1e-5


def test_auto_picks_fused_on_cpu_and_foreach_when_a_wrapper_cannot():
    from core.optimizers import optimizer_kernel
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_kernel("auto", params) == {"fused": True, "foreach": False}
    assert optimizer_kernel("auto", params, fused_ok=False) == {"fused": False, "foreach": True}
    with pytest.raises(ConfigError, match="optimizer_impl: fused is not supported"):
        optimizer_kernel("fused", params, fused_ok=False)


@pytest.mark.parametrize("strategy", [slow({"strategy": "oss", "oss_impl": "torch"}), slow({"strategy": "oss"}),
                                      {"strategy": "fsdp"}])
def test_fused_adamw_under_sharded_optimizers_matches_one_process(tmp_path, strategy):
    """ZeroRedundancyOptimizer, fairscale OSS and FSDP2 (DTensor parameters) with the fused kernel: the same
    parameters as one process with the for-loop AdamW on the combined batch."""
    common = dict(model={"dropout": 0.0}, train={"max_steps": 4, "eval_every": 0, "save_every": 0, "lr": 3e-3,
                                                   "weight_decay": 0.01})
    sharded = make_config(tmp_path / "sharded", dist={**strategy, "procs_per_node": 2},
                          **{**common, "train": {**common["train"], "batch_size": 16, "optimizer_impl": "fused"}})
    one = make_config(tmp_path / "one", **{**common, "train": {**common["train"], "batch_size": 32,
                                                              "optimizer_impl": "for_loop"}})
    assert max_diff(train(sharded), train(one)) < 1e-5


# ---- activation checkpointing ---------------------------------------------------------------------------------
def tiny_gpt2(dropout):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=3, n_head=2,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def saved_bytes_and_grads(model, ids):
    """Forward + backward; the bytes autograd kept for backward during forward, and the gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    torch.manual_seed(1)  # the same dropout masks for both models
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    forward_saved = sum(saved)  # (recomputation in backward saves more, but only one block at a time)
    loss.backward()
    return forward_saved, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_gradients_less_saved_memory():
    from strategies.activation_checkpointing import apply_ac
    plain, ckpt = tiny_gpt2(0.1), tiny_gpt2(0.1)
    assert apply_ac(ckpt, "gpt2_lm") == 3  # GPT-2's blocks, model.transformer.h
    plain.train(), ckpt.train()
    ids = torch.randint(0, 100, (8, 32))
    plain_bytes, plain_grads = saved_bytes_and_grads(plain, ids)
    ckpt_bytes, ckpt_grads = saved_bytes_and_grads(ckpt, ids)
    assert max((plain_grads[n] - ckpt_grads[n]).abs().max().item() for n in plain_grads) < 1e-6  # dropout included
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)


def test_activation_checkpointing_needs_blocks_and_is_refused_under_pipe(tmp_path):
    cfg = make_config(tmp_path, model={"activation_checkpointing": True}, train={"max_steps": 1})
    with pytest.raises(ConfigError, match="model.activation_checkpointing: the image model has no blocks"):
        _build_trainer(cfg)
    for key in ("model.activation_checkpointing", "train.compile"):
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=f"`{key}` is not available with dist.strategy: pipe"):
            make_config(tmp_path, task="gpt2_lm", **{section: {name: True}},
                        dist={"strategy": "pipe", "procs_per_node": 2})


def test_activation_checkpointing_is_refused_for_image_folders_batchnorm(tmp_path):
    """The ResNet's stages are blocks (nn.ModuleList), but their BatchNorm layers update the running statistics in
    every forward: the recomputation in backward updated them a second time each step (momentum doubled,
    num_batches_tracked counting twice), and evaluation used those without a word. Refused in one line."""
    from strategies.activation_checkpointing import apply_ac
    from tasks.image_folder import resnet
    x, buffers = torch.randn(4, 3, 32, 32), {}
    for ckpt in (False, True):  # what it would do: twice the updates
        torch.manual_seed(0)
        model = resnet("resnet18", 8, ["a", "b"]).train()
        if ckpt:
            apply_ac(model, "image_folder")
        model(pixel_values=x).logits.sum().backward()
        buffers[ckpt] = dict(model.named_buffers())
    assert max_diff(buffers[False], buffers[True]) > 0.5
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, task="image_folder", model={"activation_checkpointing": True})
    assert str(e.value).startswith("test: `model.activation_checkpointing` is refused for image_folder") and \
        "BatchNorm" in str(e.value) and "\n" not in str(e.value)


def _build_trainer(cfg):
    from core import process_group
    from wiring import build_task
    from wiring import build_trainer
    return build_trainer(cfg, process_group.init(cfg, 0, 1, 0))


# ---- profiling ------------------------------------------------------------------------------------------------
def test_profile_steps_write_a_readable_trace_of_those_steps(tmp_path):
    cfg = make_config(tmp_path, train={"max_steps": 5, "eval_every": 0, "save_every": 0,
                                       "profile_steps": [2, 3]})
    assert main.run(cfg) == 0
    traces = glob.glob(str(tmp_path / "profile" / "rank0.*.pt.trace.json"))
    assert len(traces) == 1
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "aten::convolution" for e in events)  # the model's work is in it


@pytest.mark.parametrize("steps", [0, [3, 2], [1, 2, 3]])
def test_bad_profile_steps_are_one_line_errors(tmp_path, steps):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        make_config(tmp_path, train={"profile_steps": steps})


# ---- torch.compile --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_gpt2_trains_like_eager():
    """train.compile's path (Strategy.compile: Module.compile in place) on a tiny GPT-2: the same loss and
    gradients as eager within relative 1e-4 for two steps with different lengths (inductor fuses and reorders
    float arithmetic; it does not change the maths), and the state-dict keys stay the same."""
    from core import process_group
    from strategies.base import Strategy
    eager, compiled = tiny_gpt2(0.0), tiny_gpt2(0.0)
    ctx = process_group.init(make_config("/tmp/unused", dist={"device": "cpu"}), 0, 1, 0)
    Strategy(compiled, compiled, None, ctx).compile()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for length in (16, 24):
        ids = torch.randint(0, 100, (4, length))
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_compile_is_refused_for_the_cnn_on_cpu(tmp_path):
    """torch 2.13's inductor on CPU returns zero gradients for the image CNN's convolutions (a 10-line repro is
    in benchmarks/RESULTS.md): refused with one line rather than training silently wrong."""
    with pytest.raises(ConfigError, match="train.compile` is refused for the image task on CPU"):
        make_config(tmp_path, train={"compile": True}, dist={"device": "cpu"})


def test_activation_checkpointing_in_a_run_under_ddp_trains_like_one_plain_process(tmp_path):
    """Through the Trainer: GPT-2 with every block recomputed, 2 DDP ranks of 4, equals one process of 8 without
    it (DDP's hooks fire on the recomputed backward too; recomputation uses the same values)."""
    import random
    from test_text_tasks import sample
    data = sample.write_gpt2(str(tmp_path / "gpt2"), random.Random(0))
    common = {"max_steps": 3, "eval_every": 0, "save_every": 3, "lr": 3e-3, "clip_grad_norm": 1.0}
    runs = {}
    for name, ckpt, dist, batch in [("plain", False, {"strategy": "none"}, 8),
                                    ("ckpt", True, {"strategy": "ddp", "procs_per_node": 2}, 4)]:
        runs[name] = train(make_config(tmp_path / name, task="gpt2_lm", data={"data_dir": data, "max_length": 16},
                                       model={"name": "tiny", "dropout": 0.0, "activation_checkpointing": ckpt},
                                       train={**common, "batch_size": batch}, dist=dist))
    assert max_diff(runs["plain"], runs["ckpt"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_under_ddp_and_per_block_under_fsdp2_trains_like_eager(tmp_path, strategy):
    """train.compile through the Trainer on 2 ranks: DDP's model compiled whole, FSDP2's blocks one by one. AdamW
    for 3 steps; measured 4.8e-5 (ddp) and 3.0e-5 (fsdp) from eager, float reordering amplified by Adam's
    normalisation of near-zero gradients (parameters move ~1e-2)."""
    import random
    from test_text_tasks import sample
    data = sample.write_gpt2(str(tmp_path / "gpt2"), random.Random(0))
    runs = {}
    for name, compiled in [("eager", False), ("compiled", True)]:
        runs[name] = train(make_config(tmp_path / name, task="gpt2_lm", data={"data_dir": data, "max_length": 16},
                                       model={"name": "tiny", "dropout": 0.0},
                                       train={"max_steps": 3, "eval_every": 0, "save_every": 3, "lr": 3e-3,
                                              "batch_size": 4, "compile": compiled},
                                       dist={"strategy": strategy, "procs_per_node": 2}))
    assert max_diff(runs["eager"], runs["compiled"]) < 2e-4


# ---- host syncs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_loop_reads_from_the_device_once_a_step_and_once_more_per_log_line(tmp_path, monkeypatch, precision):
    """On a GPU every read of a tensor's value on the host (.item(), .tolist(), float(t), bool(t), .cpu(),
    .numpy()) makes the CPU wait for the device, which then idles until the CPU has queued more work. The loop
    reads once per step (train_step: the gradient norm, which decides whether the update is applied, and the
    stop votes) and once per log line (the loss window). On CPU nothing waits, but the reads can be counted by
    the line of this project's code that makes them: one read added to the loop by an edit fails here."""
    import sys
    from core import distributed, process_group
    from wiring import build_task
    from wiring import build_trainer
    ours, trainer, reads = os.path.dirname(os.path.abspath(main.__file__)), None, {}
    for name in ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"]:
        def counted(self, *args, _read=getattr(torch.Tensor, name), _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if trainer is not None and caller.startswith(ours) and os.sep + "tests" + os.sep not in caller:
                where = f"{os.path.basename(caller)}:{sys._getframe(1).f_lineno} {_name}"
                reads.setdefault(trainer.state.step, []).append(where)  # by the steps done when it was made
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    cfg = make_config(tmp_path, train={"max_steps": 10, "log_every": 4, "eval_every": 0, "save_every": 0,
                                       "precision": precision}, dist={"device": "cpu"})
    ctx = process_group.init(cfg, 0, 1, 0)
    try:
        trainer = build_trainer(cfg, ctx)
        trainer.train()
    finally:
        distributed.shutdown(ctx)
    # After s steps: the next step's read, and after steps 4 and 8 the log line's (after 10 come the last log
    # line, the evaluation and the save, which wait for the device anyway).
    middle = {s: len(r) for s, r in reads.items() if s < 10}
    assert middle == {s: 2 if s in (4, 8) else 1 for s in range(10)}, {s: reads[s] for s in sorted(reads)}


@pytest.mark.slow
def test_fsdp2s_per_block_compile_compiles_checkpointed_gpt2_blocks(tmp_path):
    """train.compile under fsdp compiles each block's forward, which model.activation_checkpointing made a
    torch.utils.checkpoint call. The training forward built transformers' KV cache (a side effect inside the
    checkpointed block), so TorchDynamo gave up on every block: train.compile ran them eagerly without a word.
    Now the blocks compile (Inductor writes code) and give eager's loss and gradients."""
    import random
    from types import SimpleNamespace
    from torch._inductor.utils import run_and_get_code
    from strategies.fsdp import FSDPStrategy
    from test_text_tasks import sample
    from wiring import build_model, build_task
    data = sample.write_gpt2(str(tmp_path / "gpt2"), random.Random(0))
    cfg = make_config(tmp_path, task="gpt2_lm", data={"data_dir": data, "max_length": 16},
                      model={"name": "tiny", "dropout": 0.0, "activation_checkpointing": True})
    task = build_task(cfg)
    task.build_datasets()  # (the tokenizer, which sizes the model)
    ids = torch.randint(0, 100, (4, 16))
    grads, losses = {}, {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model, _ = build_model(cfg, task)
        if name == "compiled":
            FSDPStrategy.compile(SimpleNamespace(model=model))  # as under fsdp: block by block
        losses[name], code = run_and_get_code(lambda: task.loss_sum(model, {"input_ids": ids, "labels": ids}))
        losses[name].backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert code, "no block was compiled"
    assert losses["compiled"].item() == pytest.approx(losses["eager"].item(), rel=1e-4)
    for n, g in grads["eager"].items():
        assert torch.allclose(grads["compiled"][n], g, rtol=1e-4, atol=1e-6), n


def test_activation_checkpointing_recomputes_sst2s_bart_like_its_forward(tmp_path):
    """sst2's own model is a BART classifier whose decoder filled transformers' KV cache in each forward: the
    recomputation in backward found it filled and saved fewer tensors, so model.activation_checkpointing failed at
    step 1 (CheckpointError) under every strategy. Now the same loss and gradients as without it."""
    import random
    from test_text_tasks import sample
    from wiring import build_model, build_task
    data = sample.write_sst2(str(tmp_path / "sst2"), random.Random(0), sizes=(40, 10, 10))
    grads, losses = {}, {}
    for ckpt in (False, True):
        cfg = make_config(tmp_path, task="sst2", data={"data_dir": data}, model={"name": "tiny", "dropout": 0.0,
                                                                                  "activation_checkpointing": ckpt})
        task = build_task(cfg)
        batch = task.collate([task.build_datasets()["train"][i] for i in range(4)])
        torch.manual_seed(0)
        model, _ = build_model(cfg, task)
        losses[ckpt] = task.loss_sum(model, batch)
        losses[ckpt].backward()
        grads[ckpt] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert losses[True].item() == pytest.approx(losses[False].item(), rel=1e-6)
    assert grads[True].keys() == grads[False].keys() and max_diff(grads[True], grads[False]) < 1e-6
