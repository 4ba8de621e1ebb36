"""train.optimizer by name (issue 34, item 2): any torch.optim class with train.optimizer_args, checked at start;
fused/foreach only where the class takes them; the plan names it; resume under ddp and fsdp is exact for another
optimizer than AdamW. Also the best checkpoint's tie rule (item 3)."""
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import trainer as trainer_module
from conftest import ROOT, make_config, slow
from wiring import checked_config
from core.errors import ConfigError
from core import optimizers
from core.optimizers import optimizer_recipe

PARAMS = os.path.join(ROOT, "parameters.yml")


def config(tmp_path, *sets):
    return checked_config(PARAMS, [f"output_dir={tmp_path}", *sets])


def build_trainer(cfg):
    from core import process_group
    import wiring
    torch.set_num_threads(1)
    return wiring.build_trainer(cfg, process_group.init(cfg, 0, 1, 0))


# ---- names and keywords, checked when the config is read -------------------------------------------------------
@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("SGD", torch.optim.SGD),
                                       ("radam", torch.optim.RAdam), ("Adafactor", torch.optim.Adafactor)])
def test_names_are_torch_optim_classes_in_any_case(name, cls):
    assert optimizers.resolve(name) is cls


@pytest.mark.parametrize("sets, words", [
    (["train.optimizer=Radamw"], ["train.optimizer", "'Radamw' is not a torch.optim class", "RAdam", "SGD",
                                  "Adafactor"]),
    (["train.optimizer=LBFGS"], ["train.optimizer", "closure", "AdamW"]),
    (["train.optimizer=RAdam", "train.optimizer_args={momentm: 0.9}"],
     ["train.optimizer_args", "'momentm' is not a keyword of RAdam", "decoupled_weight_decay"]),
    (["train.optimizer=SGD", "train.optimizer_args={lr: 0.1}"], ["train.optimizer_args", "lr", "train.lr"]),
    (["train.optimizer=RAdam", "train.optimizer_args={eps: 0.1}"], ["train.optimizer_args", "train.eps"]),
    (["train.optimizer=SGD", "train.optimizer_args={fused: true}"], ["train.optimizer_impl"]),
    (["train.optimizer=SGD", "train.optimizer_args={momentum: -1}"], ["SGD refuses them", "momentum"]),
    (["train.optimizer=SGD", "train.optimizer_args={momentum: .nan}"],  # issue 40: SGD itself takes NaN
     ["train.optimizer_args.momentum", "is nan: not a finite number"]),
    (["train.optimizer=AdamW", "train.optimizer_args={amsgrad: 1}"], ["optimizer_args.amsgrad", "not true or false"]),
    (["train.optimizer=Adafactor", "train.optimizer_args={eps: [null, .inf]}"], ["eps", "holds inf, not a finite"]),
    (["train.optimizer=SGD", "train.betas=[0.9, 0.99]"], ["train.betas", "SGD does not take it"]),
    (["train.optimizer=Rprop", "train.weight_decay=0.1"], ["train.weight_decay", "Rprop has no weight decay"]),
    (["train.optimizer=RAdam", "train.optimizer_impl=fused"], ["train.optimizer_impl", "RAdam"]),
    (["train.optimizer=SGD", "train.optimizer_args=[1, 2]"], ["train.optimizer_args", "a mapping"]),
])
def test_wrong_names_and_keywords_are_one_line_config_errors(tmp_path, sets, words):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, *sets)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.slow  # 5 s: `python main.py`; quick loop: the config errors' unit test
def test_a_wrong_name_exits_2_before_anything_runs(tmp_path):
    run = subprocess.run([sys.executable, "main.py", "--params", "parameters.yml", "--set",
                          f"output_dir={tmp_path}", "--set", "train.optimizer=Nadamw"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.optimizer" in lines[0] and "NAdam" in lines[0], run.stderr
    assert not os.path.exists(tmp_path / "checkpoints")


# ---- what reaches the optimizer ----------------------------------------------------------------------------------
def recipe(tmp_path, *sets, model=None):
    model = model or nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    groups, cls, kwargs = optimizer_recipe(model, config(tmp_path, *sets).train)
    return cls(groups, **kwargs)


def test_radam_gets_no_fused_keyword_and_steps(tmp_path):
    # The trap of the issue: the AdamW line copied for RAdam raised TypeError on `fused`.
    opt = recipe(tmp_path, "train.optimizer=RAdam", "train.betas=[0.8, 0.95]", "train.weight_decay=0.1",
                 "train.optimizer_args={decoupled_weight_decay: true}")
    assert isinstance(opt, torch.optim.RAdam) and "fused" not in opt.defaults and opt.defaults["foreach"]
    assert all(g["betas"] == (0.8, 0.95) and g["decoupled_weight_decay"] for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # matrices, then biases and norms
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


def test_sgd_takes_its_keywords_and_keeps_momentum_by_default(tmp_path):
    assert recipe(tmp_path, "train.optimizer=sgd").defaults["momentum"] == 0.9
    opt = recipe(tmp_path, "train.optimizer=SGD", "train.optimizer_args={momentum: 0.5, nesterov: true}")
    assert opt.defaults["momentum"] == 0.5 and opt.defaults["nesterov"] and opt.defaults["fused"]


def test_eps_at_its_default_leaves_each_class_its_own(tmp_path):
    assert recipe(tmp_path, "train.optimizer=Adadelta").defaults["eps"] == 1e-6  # torch's, not Adam's 1e-8
    assert recipe(tmp_path, "train.optimizer=Adadelta", "train.eps=1e-5").defaults["eps"] == 1e-5
    assert recipe(tmp_path, "train.optimizer=Adafactor",
                  "train.optimizer_args={eps: [null, 0.01]}").defaults["eps"] == (None, 0.01)


@pytest.mark.parametrize("name", sorted(n for n in optimizers.choices() if n not in optimizers.REFUSED))
def test_every_torch_optimizer_builds_and_steps(tmp_path, name):
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    before = [p.detach().clone() for p in model.parameters()]
    opt = recipe(tmp_path, f"train.optimizer={name}", model=model)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), f"{name} did not move"


def test_a_hand_written_optimizer_listed_by_name(tmp_path, monkeypatch):
    class Halve(torch.optim.Optimizer):
        """p -= lr * sign(grad) * scale: takes the groups, lr and its own keyword, nothing else."""

        def __init__(self, params, lr=0.1, scale=1.0):
            super().__init__(params, {"lr": lr, "scale": scale})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.data -= g["lr"] * g["scale"] * p.grad.sign()

    monkeypatch.setitem(optimizers.OPTIMIZERS, "Halve", Halve)
    opt = recipe(tmp_path, "train.optimizer=halve", "train.optimizer_args={scale: 0.5}")
    assert isinstance(opt, Halve) and opt.defaults == {"lr": 1e-3, "scale": 0.5}


def test_the_plan_names_the_optimizer_its_arguments_and_the_tie_rule(tmp_path, capsys):
    from core import run_record
    cfg = make_config(tmp_path, train={"optimizer": "SGD", "optimizer_args": {"nesterov": True}, "max_steps": 1,
                                       "weight_decay": 0.01})
    plan = run_record.plan(build_trainer(cfg))
    line = next(x for x in plan.splitlines() if "optimizer SGD(" in x)
    assert "lr=0.001" in line and "momentum=0.9" in line and "nesterov=True" in line and "0.01" in line, plan
    assert "fused" in line or "foreach" in line, line
    assert "best checkpoint: the highest dev accuracy, a tie to the lower dev loss" in plan, plan


# ---- resume is exact with other optimizers, under ddp and fsdp --------------------------------------------------
STEPS, SAVE_AT = 6, 3
TRAIN = {"max_steps": STEPS, "save_every": SAVE_AT, "eval_every": 0, "keep_last": 5, "lr": 0.01,
         "log_every": 1, "eval_batch_size": 64, "batch_size": 16}


def train(output_dir, strategy, optimizer, **extra):
    """strategy: a dist.strategy, or `oss-torch` (PyTorch's ZeroRedundancyOptimizer around the class)."""
    from main import run
    dist = {"strategy": "oss", "oss_impl": "torch"} if strategy == "oss-torch" else {"strategy": strategy}
    cfg = make_config(output_dir, model={"dropout": 0.0}, train={**TRAIN, **optimizer, **extra},
                      dist={**dist, "procs_per_node": 2})
    return run(cfg)


def params(output_dir, step):
    from core.checkpoint_io import model_state_dict
    return model_state_dict(os.path.join(output_dir, "checkpoints", f"step-{step}"))


SGD_NESTEROV = {"optimizer": "SGD", "optimizer_args": {"momentum": 0.9, "nesterov": True}}
RADAM = {"optimizer": "RAdam", "weight_decay": 0.01, "optimizer_args": {"decoupled_weight_decay": True}}


# All slow (~30-70 s each on 2 shared cores); the quick loop's multi-process run is test_labels_export's ddp one.
@pytest.mark.parametrize("strategy, optimizer", [
    slow("fsdp", RADAM), slow("ddp", RADAM), slow("ddp", SGD_NESTEROV), slow("fsdp", SGD_NESTEROV),
    slow("oss", RADAM), slow("oss-torch", SGD_NESTEROV)])
def test_resume_ends_where_an_uninterrupted_run_does(tmp_path, strategy, optimizer):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    assert train(first, strategy, optimizer) == 0
    assert train(resumed, strategy, optimizer, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    a, b = params(resumed, STEPS), params(first, STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = params(first, SAVE_AT)
    assert any(not torch.equal(start[k], b[k]) for k in b)  # the last steps trained


# ---- changed hyperparameters on resume apply under every strategy (issue 40, item 4) ------------------------------
CHANGES = {"SGD": ({"optimizer": "SGD"}, {"optimizer": "SGD", "optimizer_args": {"momentum": 0.5}},
                   "momentum 0.9 -> 0.5", {"momentum": 0.5}),
           "AdamW": ({"optimizer": "AdamW", "weight_decay": 0.01},
                     {"optimizer": "AdamW", "weight_decay": 0.1, "betas": [0.8, 0.99]},
                     "betas [0.9, 0.999] -> [0.8, 0.99], weight_decay 0.01 -> 0.1",
                     {"betas": [0.8, 0.99], "weight_decay": 0.1})}


# ddp with SGD is the quick loop's (~40 s: two 2-rank runs); under none/dp/ddp/oss the saved values used to stay.
@pytest.mark.parametrize("strategy, optimizer", [
    ("ddp", "SGD"), slow("ddp", "AdamW"), slow("fsdp", "SGD"), slow("fsdp", "AdamW")])
def test_changed_hyperparameters_apply_after_resume_and_are_said_once(tmp_path, strategy, optimizer):
    from core import checkpoint_meta
    before, after, line, applied = CHANGES[optimizer]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    assert train(first, strategy, before, max_steps=SAVE_AT) == 0
    assert train(resumed, strategy, after, resume=str(first / "checkpoints" / f"step-{SAVE_AT}")) == 0
    with open(resumed / "logs" / "rank0.log") as f:
        log = f.read()
    assert log.count(f"resuming with optimizer {line}: the configured values apply from step {SAVE_AT} on") == 1
    saved = checkpoint_meta.read(str(resumed / "checkpoints" / f"step-{STEPS}"))["optimizer"]  # what the groups held
    assert {k: saved[k] for k in applied} == applied, saved


# ---- the best checkpoint: a tie goes to the lower dev loss (issue 34, item 1) ----------------------------------
def test_a_tie_of_best_metric_goes_to_the_lower_dev_loss():
    fake = types.SimpleNamespace(state=trainer_module.TrainState(), train_cfg=types.SimpleNamespace(patience=2, keep_best=1),
                                 best_metric="accuracy", best_mode="max")
    track = lambda step, acc, loss: (setattr(fake.state, "step", step),  # noqa: E731
                                     trainer_module.Trainer.track_best(fake, {"accuracy": acc, "loss": loss}))[1]
    assert track(20, 0.9, 0.65) == (True, False)
    assert track(40, 0.9, 0.70) == (False, False)  # same accuracy, higher loss: not better
    assert track(60, 0.9, 0.19) == (True, False)  # same accuracy, lower loss: the new best
    assert (fake.state.best_step, fake.state.best_loss) == (60, 0.19)
    assert track(80, 0.8, 0.01) == (False, False)  # a lower loss never beats a higher accuracy
    assert track(100, 0.9, 0.19) == (False, True)  # an exact tie is no improvement: patience runs out


def test_a_tie_with_a_best_of_nan_dev_loss_goes_to_the_finite_loss_as_keep_best_ranks_it():
    """A best whose dev loss was NaN (kept as None) won every tie: the finite loss of an equal accuracy was not
    lower than it, while keep_best ranked it first; test mode read the one, keep_best's first was the other."""
    fake = types.SimpleNamespace(state=trainer_module.TrainState(), best_metric="accuracy", best_mode="max",
                                 train_cfg=types.SimpleNamespace(patience=0, keep_best=3))
    for step, loss in ((20, float("nan")), (40, 0.5), (60, float("nan"))):
        fake.state.step = step
        trainer_module.Trainer.track_best(fake, {"accuracy": 0.9, "loss": loss})
    assert fake.state.best_step == 40 and [step for _, _, step in fake.state.best_k] == [40, 20, 60]


def test_a_tie_of_an_ema_metric_goes_to_the_lower_loss_of_the_average():
    """best_metric ema_accuracy: a tie went to the trained weights' dev loss, so the best that test, export and predict
    read as the average could be the one whose average had the higher loss (keep_best ranked it so too)."""
    fake = types.SimpleNamespace(state=trainer_module.TrainState(), best_metric="ema_accuracy", best_mode="max",
                                 train_cfg=types.SimpleNamespace(patience=0, keep_best=2))
    for step, loss, ema_loss in ((1, 1.0, 2.0), (2, 1.5, 1.2)):
        fake.state.step = step
        trainer_module.Trainer.track_best(fake, {"loss": loss, "accuracy": 0.5, "ema_loss": ema_loss,
                                                 "ema_accuracy": 0.7})
    assert (fake.state.best_step, fake.state.best_loss) == (2, 1.2)
    assert [step for _, _, step in fake.state.best_k] == [2, 1]
