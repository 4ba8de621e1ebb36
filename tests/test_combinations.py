"""Task x strategy x mode x knob combinations: each either runs (and matches one process where the docs promise it)
or is refused before training in one line naming the keys, exit code 2."""
import os
import random
import subprocess
import sys

import pytest

from conftest import ROOT, logged, make_config

from core import checkpoint_io
from core.errors import ConfigError
import main
from tasks.base import Task
from wiring import TASKS

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_sample_text_data as sample  # noqa: E402


def test_a_task_without_a_pipeline_chain_or_a_tp_plan_is_refused_before_the_ranks_start(tmp_path):
    # csv_text under pipe was a NotImplementedError traceback from every rank; image under tp a line from the ranks.
    cells = [
        ("csv_text", {"strategy": "pipe", "procs_per_node": 2}, "`dist.strategy` is pipe, but task csv_text"),
        ("image", {"strategy": "ddp", "procs_per_node": 2, "tp": 2}, "`dist.tp` is 2, but task image"),
        ("csv_text", {"strategy": "fsdp", "procs_per_node": 2, "tp": 2}, "`dist.tp` is 2, but task csv_text"),
        ("image_folder", {"strategy": "pipe", "procs_per_node": 4, "tp": 2}, "`dist.tp` is 2, but task image_folder"),
    ]
    for task, dist, words in cells:
        with pytest.raises(ConfigError) as e:
            make_config(tmp_path, task=task, dist=dist)
        assert words in str(e.value) and "\n" not in str(e.value), (task, dist, str(e.value))
    # mode predict of a task that reads no new inputs: said once the ranks had started and loaded the task
    with pytest.raises(ConfigError, match="`mode` is predict, but task gpt2_lm reads no new inputs"):
        make_config(tmp_path, task="gpt2_lm", mode="predict", predict={"input": str(tmp_path)})


def test_every_task_declares_what_it_overrides():
    # wiring sniffed `TASKS[t].pipeline_layers is Task.pipeline_layers` (and predict hasattr(task, "predict_inputs")):
    # now each Task says so in an attribute; one that overrides a method without it (or the reverse) would drift.
    # (new inputs: predict_inputs all at once, or predict_chunks a chunk at a time, as the tasks here do)
    said = {"has_pipeline_chain": ("pipeline_layers",), "has_tp_plan": ("tp_plan",), "has_lengths": ("lengths",),
            "reads_new_inputs": ("predict_inputs", "predict_chunks")}
    for name, cls in TASKS.items():
        for flag, methods in said.items():
            overrides = any(getattr(cls, method, None) is not getattr(Task, method, None) for method in methods)
            assert getattr(cls, flag) is overrides, (name, flag, methods)
        # an image classifier's export saves its preprocessing (extras/export.py): the interface names the method
        processes_images = cls.hf_image_processor is not Task.hf_image_processor
        assert processes_images == (cls.hf_pipeline == "image-classification"), name


@pytest.mark.slow
def test_frozen_biases_stay_frozen_under_sequence_parallelism(tmp_path):
    # model.bias false freezes zero biases; torch's SequenceParallel made the norms' biases trainable again, so
    # tp with sequence parallelism trained them (silently unlike one process: the shakespeare_char preset).
    text = sample.write_gpt2(str(tmp_path / "gpt2"), random.Random(0))
    model = {"arch": "gpt2", "layers": 2, "heads": 4, "width": 32, "dropout": 0.0, "bias": False}
    train = {"optimizer": "sgd", "lr": 0.5, "max_steps": 2, "epochs": 0, "batch_size": 8, "eval_every": 0,
             "save_every": 0, "limit_eval_batches": 1}
    runs = {"one": {"strategy": "none"},
            "tp_sp": {"strategy": "ddp", "procs_per_node": 2, "tp": 2, "sequence_parallel": True}}
    states = {}
    for name, dist in runs.items():
        cfg = make_config(tmp_path / name, task="gpt2_lm", data={"data_dir": text, "max_length": 16}, model=model,
                          train=train, dist=dist)
        assert main.run(cfg) == 0, name
        states[name] = checkpoint_io.model_state_dict(str(tmp_path / name / "checkpoints" / "step-2"))
    biases = [k for k in states["one"] if k.endswith("bias") and "attn.bias" not in k]
    assert any(".ln_" in k for k in biases)
    assert all(not states["tp_sp"][k].any() for k in biases), [k for k in biases if states["tp_sp"][k].any()]
    assert max((states["one"][k] - states["tp_sp"][k]).abs().max().item() for k in states["one"]) <= 1e-5


SCHEMA_MISTAKES = [  # (--set, the key its one line names): the keys a user edits most, each said before torch loads
    ("train.lr=0", "train.lr"), ("train.batch_size=0", "train.batch_size"), ("train.batch_size=[8, 0]",
                                                                            "train.batch_size"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps"), ("train.precision=fp8", "train.precision"),
    ("train.max_steps=-1", "train.max_steps"), ("train.ema_decay=1", "train.ema_decay"),
    ("data.num_workers=-1", "data.num_workers"), ("data.max_length=0", "data.max_length"),
    ("data.min_class_count=0", "data.min_class_count"), ("dist.strategy=ddpp", "dist.strategy"),
    ("dist.tp=0", "dist.tp"), ("dist.timeout_s=0", "dist.timeout_s"), ("trian.lr=1", "trian"),
    ("train.lr_rate=1", "train.lr_rate"),
]


def test_schema_mistakes_of_the_keys_users_edit_are_one_line_before_torch_loads():
    # data.min_class_count 0 was accepted (image), or refused by csv_text's ranks once its data was read.
    script = ("import sys; from core.config import read_config; from core.errors import ConfigError\n"
              "for item in sys.argv[1:]:\n"
              "    try:\n        read_config(None, [item])\n        print('accepted', item)\n"
              "    except ConfigError as e:\n        print(str(e).replace(chr(10), ' NEWLINE '))\n"
              "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script] + [s for s, _ in SCHEMA_MISTAKES], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1] == "False"  # torch never loaded
    for (item, key), line in zip(SCHEMA_MISTAKES, out):
        assert line.startswith("<defaults> + --set: ") and f"`{key}`" in line and "NEWLINE" not in line, (item, line)


@pytest.mark.slow
def test_fp16_with_the_default_fused_adamw_under_the_sharded_scaler(tmp_path):
    # fsdp and pipe (ShardedGradScaler: a found_inf of shape [1]) with AdamW's fused CPU kernel, which subtracts it
    # from each 0-d step count: `RuntimeError: output with shape [] doesn't match the broadcast shape [1]`, step 1.
    train = {"precision": "fp16", "max_steps": 3, "epochs": 0, "batch_size": 8, "log_every": 1, "eval_every": 0,
             "save_every": 0, "limit_eval_batches": 1}
    layouts = {"one": ({"strategy": "none"}, 8), "fsdp": ({"strategy": "fsdp", "procs_per_node": 2}, 4),
               "pipe": ({"strategy": "pipe", "procs_per_node": 2, "pp_microbatches": 2}, 8)}
    losses = {}
    for name, (dist, batch) in layouts.items():
        cfg = make_config(tmp_path / name, model={"dropout": 0.0}, train={**train, "batch_size": batch}, dist=dist)
        assert main.run(cfg) == 0, name
        assert "AdamW(" in (tmp_path / name / "logs" / "rank0.log").read_text() and "fused" in \
            (tmp_path / name / "logs" / "rank0.log").read_text()
        losses[name] = logged(tmp_path / name, "loss")
    assert losses["fsdp"] == pytest.approx(losses["one"], rel=1e-2)
    assert losses["pipe"] == pytest.approx(losses["one"], rel=1e-2)


def test_loss_parallel_with_tied_embeddings_is_refused_before_the_ranks_start(tmp_path):
    # gpt2_lm's model ties its head to the embedding unless model.tie_embeddings is false: loss_parallel with the
    # defaults was refused by every rank once started and the model built, in a line naming no file.
    tp = {"strategy": "ddp", "procs_per_node": 2, "tp": 2, "loss_parallel": True}
    for model in ({}, {"tie_embeddings": True}, {"arch": "llama"}):
        with pytest.raises(ConfigError) as e:
            make_config(tmp_path, task="gpt2_lm", model=model, dist=tp)
        assert str(e.value).startswith("test: `dist.loss_parallel`") and "model.tie_embeddings: false" in \
            str(e.value) and "\n" not in str(e.value), (model, str(e.value))
    make_config(tmp_path, task="gpt2_lm", model={"tie_embeddings": False}, dist=tp)  # untied: accepted
