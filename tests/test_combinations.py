"""Task x strategy x mode x knob combinations: each either runs (and matches one process where the docs promise it)
or is refused before training in one line naming the keys, exit code 2."""
import os
import random
import sys

import pytest

from conftest import ROOT, make_config

from core import checkpoint_io
from core.errors import ConfigError
import main

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
