"""Fault drill: break runs on purpose, the ways a cluster does, and count what survived.

    python benchmarks/fault_drill.py [--kill-trials 12 --signal-trials 2 --quick]

Prints, for 2-rank DDP runs of the digits CNN on this machine (gloo):
  - kill -9 of the whole job at random moments (many of them inside a save or a pruning, since every step saves
    and keeps one checkpoint), then the same command again: how many runs finished with parameters bit-equal to an
    uninterrupted run;
  - SIGTERM / SIGINT / SIGUSR1 / train.time_limit: how many stopped with exit code 3 and a loadable checkpoint;
  - seconds from kill -9 of one rank to the end of the run, and from SIGSTOP of one rank to the end of the run
    (dist.hang_timeout_s=5);
  - NaN: runs with lr=1e6 stopped with exit code 4, no non-finite checkpoint;
  - bad inputs: how many kinds of mistake (config, data, checkpoint, environment) end with exit code 2 and one
    `error:` line, with no traceback.
Every case runs `python main.py` (or tests/faulty_main.py, for a slowed run) in a subprocess, as a user would.
"""
import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(fault=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_", "FAULT"))}
    e.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    if fault:
        e["FAULT"] = fault
    return e


def cmd(out, *extra, steps=60, procs=2, script="main.py"):
    return [sys.executable, script, "--params", "parameters.yml", "--set", f"output_dir={out}",
            "--set", "dist.strategy=ddp", "--set", f"dist.procs_per_node={procs}",
            "--set", f"dist.master_port={free_port()}", "--set", "log.tensorboard=false",
            "--set", "log.progress_bar=false", "--set", "model.dropout=0", "--set", "train.eval_every=0",
            "--set", f"train.max_steps={steps}", "--set", "train.epochs=0", "--set", "train.log_every=1",
            "--set", "train.batch_size=16", *extra]


def run(argv, fault=None, timeout=300):
    return subprocess.run(argv, cwd=ROOT, env=env(fault), capture_output=True, text=True, timeout=timeout)


def start(argv, fault=None):
    return subprocess.Popen(argv, cwd=ROOT, env=env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def model_of(out, step):
    return torch.load(os.path.join(out, "checkpoints", f"step-{step}", "model.pt"), weights_only=True)


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_log(out, rank, pattern, timeout=120):
    path, deadline = os.path.join(out, "logs", f"rank{rank}.log"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and re.search(pattern, open(path).read()):
            return True
        time.sleep(0.05)
    return False


def ranks_of(proc):
    kids = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    return sorted(kids, key=lambda c: c.create_time())


# ==============================================================================================================
def kill_trials(tmp, n, rng):
    ref = os.path.join(tmp, "ref")
    assert run(cmd(ref, "--set", "train.save_every=1", "--set", "train.keep_last=1")).returncode == 0
    reference = model_of(ref, 60)
    exact = 0
    for i in range(n):
        out = os.path.join(tmp, f"kill{i}")
        p = start(cmd(out, "--set", "train.save_every=1", "--set", "train.keep_last=1"))
        wait_log(out, 0, r"step \d+/60")
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere in the run: every step saves and prunes
        os.killpg(p.pid, signal.SIGKILL)
        for c in psutil.Process(p.pid).children(recursive=True) if psutil.pid_exists(p.pid) else []:
            c.kill()
        p.wait()
        r = run(cmd(out, "--set", "train.save_every=1", "--set", "train.keep_last=1"))
        ok = r.returncode == 0 and equal(model_of(out, 60), reference)
        exact += ok
        if not ok:
            print(f"  kill trial {i}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return exact


def signal_trials(tmp, n):
    ok, total = 0, 0
    for how in ("SIGTERM", "SIGINT", "SIGUSR1", "time_limit"):
        for i in range(n):
            out = os.path.join(tmp, f"{how}{i}")
            extra = ["--set", "train.time_limit=6"] if how == "time_limit" else []
            p = start(cmd(out, *extra, steps=100000, script="tests/faulty_main.py"), fault="slow:-1:50")
            if how != "time_limit":
                wait_log(out, 0, r"step 3/")
                os.killpg(p.pid, signal.SIGINT) if how == "SIGINT" else p.send_signal(getattr(signal, how))
            stdout, _ = p.communicate(timeout=120)
            m = re.search(r"saved step-(\d+)", stdout)
            good = p.returncode == 3 and m is not None and \
                os.path.exists(os.path.join(out, "checkpoints", f"step-{m.group(1)}", "meta.json"))
            ok, total = ok + good, total + 1
    return ok, total


def detection_seconds(tmp, how, trial):
    out = os.path.join(tmp, f"detect-{how}{trial}")
    p = start(cmd(out, "--set", "dist.hang_timeout_s=5", steps=100000, script="tests/faulty_main.py"),
              fault="slow:-1:20")
    ranks = ranks_of(p) if wait_log(out, 1, r"step 3/") else []
    if len(ranks) < 2:
        p.kill()
        return float("nan"), "did not start: " + p.communicate()[1].strip()[-300:]
    victim = ranks[1]
    victim.kill() if how == "dead" else victim.suspend()
    t0 = time.monotonic()
    _, stderr = p.communicate(timeout=120)
    return time.monotonic() - t0, stderr.strip().splitlines()[0] if stderr.strip() else ""


def nan_runs(tmp, n):
    stopped = 0
    for i in range(n):
        out = os.path.join(tmp, f"nan{i}")
        r = run(cmd(out, "--set", f"train.lr={10 ** (5 + i)}", "--set", "train.save_every=1", procs=1,
                    steps=200) + ["--set", "dist.strategy=none"])
        finite = all(torch.isfinite(v).all() for d in os.listdir(os.path.join(out, "checkpoints"))
                     if d.startswith("step-") for v in model_of(out, int(d[5:])).values()) \
            if os.path.isdir(os.path.join(out, "checkpoints")) else True
        stopped += r.returncode == 4 and finite
        if r.returncode != 4:
            print(f"  lr {10 ** (5 + i)}: exit {r.returncode} (did not diverge: {r.stdout.strip().splitlines()[-1]})")
    return stopped


# ==============================================================================================================
# Bad inputs: each (name, argv-extra or setup function) must give exit 2 and one `error:` line
# ==============================================================================================================
def bad_inputs(tmp):
    good = os.path.join(tmp, "good")
    assert run(cmd(good, procs=1, steps=2) + ["--set", "dist.strategy=none"]).returncode == 0
    ckpt = os.path.join(good, "checkpoints", "step-2")

    def copy_ckpt(name, mutate):
        dst = os.path.join(tmp, "bad-ckpt", name, "checkpoints", "step-2")
        shutil.copytree(ckpt, dst)
        mutate(dst)
        return ["--set", f"output_dir={os.path.dirname(os.path.dirname(dst))}"]

    def write(name, text, binary=False):
        path = os.path.join(tmp, "files", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if binary else "w") as f:
            f.write(text)
        return path

    yml = write("bad.yml", "train:\n  lr: [1, 2\n")
    cases = {
        "unknown key": ["--set", "train.lrr=1"],
        "unknown section value": ["--set", "train=3"],
        "malformed --set": ["--set", "train.lr"],
        "wrong type": ["--set", "train.lr=fast"],
        "negative lr": ["--set", "train.lr=-1"],
        "bad YAML": ["--params", yml],
        "missing params file": ["--params", os.path.join(tmp, "nope.yml")],
        "unknown task": ["--set", "task=imagee"],
        "bad strategy": ["--set", "dist.strategy=zero"],
        "batch list vs ranks": ["--set", "train.batch_size=[8,8,8]"],
        "node_rank out of range": ["--set", "dist.node_rank=3"],
        "port out of range": ["--set", "dist.master_port=70000"],
        "nccl on CPU": ["--set", "dist.backend=nccl"],
        "bad time_limit": ["--set", "train.time_limit=soon"],
        "bad stop_signal": ["--set", "train.stop_signal=SIGKILL"],
        "bad max_bad_steps": ["--set", "train.max_bad_steps=0"],
        "negative hang_timeout_s": ["--set", "dist.hang_timeout_s=-1"],
        "dropout out of range": ["--set", "model.dropout=1.5"],
        "missing pretrained_dir": ["--set", "model.pretrained_dir=/nonexistent"],
        "output_dir is a file": ["--set", f"output_dir={write('plainfile', 'x')}"],
        "output_dir under a file": ["--set", f"output_dir={write('plainfile2', 'x')}/sub"],
        "resume path missing": ["--set", f"train.resume={tmp}/no/step-1"],
        "MNIST files missing, offline": ["--set", "data.dataset=mnist", "--set", f"data.data_dir={tmp}/nomnist",
                                         "--set", "data.download=false"],
        "bert shards missing": ["--set", "task=bert_pretrain", "--set", f"data.data_dir={tmp}/nobert",
                                "--set", "model.name=tiny"],
        "gpt2 text missing": ["--set", "task=gpt2_lm", "--set", f"data.data_dir={tmp}/nogpt",
                              "--set", "model.name=tiny"],
        "0-byte model.pt": copy_ckpt("zero", lambda d: open(os.path.join(d, "model.pt"), "w").close()),
        "{} meta.json": copy_ckpt("emptymeta", lambda d: open(os.path.join(d, "meta.json"), "w").write("{}")),
        "meta.json not JSON": copy_ckpt("badjson", lambda d: open(os.path.join(d, "meta.json"), "w").write("{")),
        "truncated state.pt": copy_ckpt("trunc", lambda d: open(os.path.join(d, "state.pt"), "r+b").truncate(40)),
        "changed model size": copy_ckpt("size", lambda d: None) + ["--set", "model.hidden=64"],
        "changed optimizer": copy_ckpt("opt", lambda d: None) + ["--set", "train.optimizer=sgd"],
        "test mode, no checkpoint": ["--set", "mode=test", "--set", f"output_dir={tmp}/empty"],
    }
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases["port in use"] = ["--set", f"dist.master_port={busy.getsockname()[1]}", "--set", "dist.procs_per_node=2"]
    clean, failures = 0, []
    for name, extra in cases.items():
        out = os.path.join(tmp, "bad", name.replace(" ", "_").replace("/", "_"))
        argv = cmd(out, procs=1, steps=2) + ["--set", "dist.strategy=none"]
        if "dist.procs_per_node=2" in extra:
            argv = cmd(out, steps=2)
        r = run(argv + extra, timeout=120)
        lines = r.stderr.strip().splitlines()
        ok = r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr
        clean += ok
        failures += [] if ok else [f"{name}: exit {r.returncode}: {r.stderr.strip()[-200:]}"]
    busy.close()
    return clean, len(cases), failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kill-trials", type=int, default=12)
    p.add_argument("--signal-trials", type=int, default=2, help="per kind of signal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=["bad", "kill", "signal", "detect", "nan"])
    args = p.parse_args()
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="fault-drill-")
    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        t0 = time.monotonic()
        if "bad" in args.only:
            clean, kinds, failures = bad_inputs(tmp)
            say(f"bad inputs: {clean}/{kinds} kinds end with exit 2 and one `error:` line, no traceback")
            for f in failures:
                say(f"  not clean: {f}")
        if "kill" in args.only:
            exact = kill_trials(tmp, args.kill_trials, rng)
            say(f"kill -9 of the whole job at random times (every step saves + prunes): {exact}/{args.kill_trials} "
                f"resumed to bit-equal final parameters")
        if "signal" in args.only:
            ok, total = signal_trials(tmp, args.signal_trials)
            say(f"SIGTERM/SIGINT/SIGUSR1/time limit: {ok}/{total} stopped with exit 3 and a complete checkpoint")
        if "detect" in args.only:
            for how in ("dead", "hung"):
                secs = [detection_seconds(tmp, how, i) for i in range(3)]
                say(f"{'kill -9' if how == 'dead' else 'SIGSTOP'} of rank 1 -> run ended in "
                    f"{', '.join(f'{s:.1f}' for s, _ in secs)} s (hang_timeout_s=5): {secs[0][1]}")
        if "nan" in args.only:
            n = nan_runs(tmp, 3)
            say(f"NaN (lr 1e5, 1e6, 1e7): {n}/3 stopped with exit 4 and only finite checkpoints")
        say(f"drill time {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
