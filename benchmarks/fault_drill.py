"""Fault drill: break runs on purpose, the ways a cluster does, and count what survived.

    python benchmarks/fault_drill.py [--kill-trials 12 --signal-trials 2 --only bad kill signal detect nan issue33
                                      bitflip issue20]

Prints, for 2-rank DDP runs of the digits CNN on this machine (gloo):
  - kill -9 of the whole job at random moments (many of them inside a save or a pruning, since every step saves
    and keeps one checkpoint), then the same command again: how many runs finished with parameters bit-equal to an
    uninterrupted run;
  - SIGTERM / SIGINT / SIGUSR1 / train.time_limit: how many stopped with exit code 3 and a loadable checkpoint;
  - seconds from kill -9 of one rank to the end of the run, and from SIGSTOP of one rank to the end of the run
    (dist.hang_timeout_s=5);
  - NaN: runs with lr=1e6 stopped with exit code 4, no non-finite checkpoint;
  - bad inputs: how many kinds of mistake (config, data, checkpoint, environment) end with exit code 2 and one
    `error:` line, with no traceback;
  - issue 33's hostile values and files (`--only issue33`): non-finite and out-of-range numbers, a warm-up longer
    than the run, output_dir=/, billion laughs, deep nesting, duplicate keys, a 2 MB or NUL-holding params file, a
    pretrained folder that needs its own code: exit 2, one `error:` line, within 20 s;
  - bit flips (`--only bitflip`, issue 33): one byte flipped in model.pt, optimizer.pt, state.pt or an fsdp
    `.distcp` shard of the newest checkpoint: resume falls back to the one before with one line naming the file,
    test mode (and export) refuse it with exit code 2 and one line;
  - issue 20's faults (`--only issue20`), one probe each, clean or not: repeated SIGTERM while stopping, SIGHUP,
    two runs on one output_dir, resume at another world size, a symlinked checkpoint with keep_last, tampered
    meta.json values, bad csv rows, an OOM-killed rank, and (as root: tmpfs mounts) a full disk or read-only
    folder under TensorBoard, the logs, the console's file, config.yml, checkpoints/, the tokenizer folder and
    dev_results.json.
Every case runs `python main.py` (or tests/faulty_main.py, for a slowed run) in a subprocess, as a user would.
"""
import argparse
import hashlib
import json
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
def bad_inputs(tmp, only=()):
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
    cases = {name: extra for name, extra in cases.items() if not only or name in only}
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


def issue33_inputs(tmp):
    """Issue 33's hostile values and files: each must end with exit code 2 and one `error:` line, within seconds."""
    def write(name, data):
        path = os.path.join(tmp, "issue33", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        return path

    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    custom = os.path.dirname(write("custom_model/config.json", '{"model_type": "my_own", "auto_map": '
                                                               '{"AutoConfig": "code.MyConfig"}}'))
    cases = {f"{key}={value}": ["--set", f"{key}={value}"] for key, value in [
        ("train.lr", "nan"), ("train.lr", "inf"), ("train.epochs", "inf"), ("train.warmup", "nan"),
        ("train.eps", "nan"), ("seed", "-1"), ("seed", str(2 ** 64)), ("dist.timeout_s", "0"),
        ("dist.timeout_s", "-5"), ("train.weight_decay", "nan"), ("train.clip_grad_norm", "nan"),
        ("train.time_limit", "nan"), ("dist.hang_timeout_s", "nan"), ("train.batch_size", "1000000000"),
        ("output_dir", "/")]}
    cases.update({
        "warm-up longer than the run": ["--set", "train.warmup=500", "--set", "train.max_steps=3"],
        "billion laughs file": ["--params", write("laughs.yml", laughs + "train:\n  lr: *i\n")],
        "billion laughs --set": ["--set", "model.lora_targets=" + laughs.replace("\n", "\n")],
        "list nested 10,000 deep": ["--params", write("deep.yml", "train:\n  lr: " + "[" * 10000 + "]" * 10000)],
        "duplicate key": ["--params", write("dup.yml", "train:\n  lr: 0.1\n  lr: 0.2\n")],
        "2 MB params file": ["--params", write("big.yml", "# " + "x" * (2 << 20) + "\n")],
        "NUL byte": ["--params", write("nul.yml", b"train:\n  max_steps: 4\x002\n")],
        "remote code folder": ["--set", "task=sst2", "--set", f"model.pretrained_dir={custom}"],
    })
    clean, failures = 0, []
    for name, extra in cases.items():
        out = os.path.join(tmp, "issue33-runs", re.sub(r"\W", "_", name)[:60])
        start = time.monotonic()
        r = run(cmd(out, procs=1, steps=2) + ["--set", "dist.strategy=none"] + extra, timeout=120)
        seconds = time.monotonic() - start
        ok, saw = one_line(r, 2, "error: ")
        ok = ok and seconds < 20
        clean += ok
        failures += [] if ok else [f"{name}: {seconds:.0f} s, {saw}"]
    return clean, len(cases), failures


# ==============================================================================================================
# Issue 20's faults: each probe returns (clean, what it saw); clean means the outcome the issue asks for
# ==============================================================================================================
def one_line(r, code, says, stream="stderr"):
    """Exit `code`, and on `stream` exactly one line, containing `says`; no traceback, no logging error, anywhere."""
    r = r if isinstance(r, dict) else {"stdout": r.stdout, "stderr": r.stderr, "returncode": r.returncode}
    both = (r["stdout"] or "") + (r["stderr"] or "")
    lines = [line for line in r[stream].strip().splitlines() if line.strip()]
    ok = r["returncode"] == code and len(lines) == 1 and says in lines[0] and "Traceback" not in both and \
        "Logging error" not in both and "Exception in thread" not in both
    return ok, f"exit {r['returncode']}: {' | '.join(lines)[-300:]}"


class Finished:
    def __init__(self, proc, timeout=180):
        self.stdout, self.stderr = proc.communicate(timeout=timeout)
        self.returncode = proc.returncode


def saved_and_loadable(out, stdout):
    m = re.findall(r"saved (\S+/step-(\d+))", stdout)
    return bool(m) and os.path.exists(os.path.join(m[-1][0], "meta.json")) and \
        model_of(out, int(m[-1][1])) is not None


def slow_run(out, tmpdir=None, *extra):
    """A 2-rank run whose steps take 300 ms, started as a user would (its own session), TMPDIR private."""
    e = env("slow:-1:300")
    if tmpdir:
        os.makedirs(tmpdir, exist_ok=True)
        e["TMPDIR"] = tmpdir
    return subprocess.Popen(cmd(out, *extra, steps=100000, script="tests/faulty_main.py"), cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def probe_repeated_sigterm(tmp):
    out = os.path.join(tmp, "sigterm-again")
    p = slow_run(out)
    wait_log(out, 0, r"step 3/")
    p.send_signal(signal.SIGTERM)
    wait_log(out, 0, r"SIGTERM received", timeout=10)
    for _ in range(3):  # while the ranks finish the step and save
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
    r = Finished(p)
    ok = r.returncode == 3 and saved_and_loadable(out, r.stdout) and "SIGTERM again: already stopping" in r.stdout \
        and "Traceback" not in r.stderr and not r.stderr.strip()
    again = r.stdout.count("SIGTERM again")
    return ok, f"exit {r.returncode}, {again} 'again' lines, stderr {r.stderr.strip()[-200:]!r}"


def probe_sighup_and_second_run(tmp):
    """SIGHUP stops like SIGTERM; meanwhile a second run on the same output_dir is refused in one line."""
    out, tmpdir = os.path.join(tmp, "sighup"), os.path.join(tmp, "sighup-tmp")
    p = slow_run(out, tmpdir)
    wait_log(out, 0, r"step 3/")
    second = one_line(run(cmd(out, steps=5)), 2, "is in use by another run")
    p.send_signal(signal.SIGHUP)
    r = Finished(p)
    left = [n for n in os.listdir(tmpdir) if n.startswith("trainer-reports-")]
    ok = r.returncode == 3 and saved_and_loadable(out, r.stdout) and not left and "Traceback" not in r.stderr
    return [("SIGHUP: exit 3, saved, no trainer-reports-* left", ok, f"exit {r.returncode}, left {left}"),
            ("two runs on one output_dir: the second refused in one line", *second)]


def probe_other_world_size(tmp):
    """ddp 2 ranks x 12 -> 3 ranks x 8 (global batch 24 kept) ends where one process of 24 does."""
    same = ["--set", "train.optimizer=sgd", "--set", "train.lr=0.05", "--set", "train.schedule=constant",
            "--set", "train.save_every=5"]
    one, a = os.path.join(tmp, "ws-one"), os.path.join(tmp, "ws-2to3")
    codes = [run(cmd(one, *same, "--set", "train.batch_size=24", "--set", "dist.strategy=none", procs=1,
                     steps=10)).returncode,
             run(cmd(a, *same, "--set", "train.batch_size=12", steps=5)).returncode]
    r = run(cmd(a, *same, "--set", "train.batch_size=8", "--set", "train.resume_changed=true", procs=3, steps=10))
    codes.append(r.returncode)
    if codes != [0, 0, 0]:
        return False, f"exit codes {codes}: {r.stderr.strip()[-300:]}"
    x, y = model_of(one, 10), model_of(a, 10)
    diff = max((x[k] - y[k]).abs().max().item() for k in x)
    return diff < 1e-5, f"max parameter difference {diff:.1e} after resuming 2 -> 3 ranks"


def probe_symlinked_checkpoint(tmp):
    good = os.path.join(tmp, "link-src")
    assert run(cmd(good, "--set", "dist.strategy=none", procs=1, steps=1)).returncode == 0
    elsewhere = os.path.join(tmp, "elsewhere")
    shutil.copytree(os.path.join(good, "checkpoints", "step-1"), elsewhere)
    out = os.path.join(tmp, "link-run")
    os.makedirs(os.path.join(out, "checkpoints"))
    os.symlink(elsewhere, os.path.join(out, "checkpoints", "step-1"))
    r = run(cmd(out, "--set", "dist.strategy=none", "--set", "train.keep_last=1", "--set", "train.save_every=1",
                procs=1, steps=3))
    ok = r.returncode == 0 and sorted(os.listdir(elsewhere)) == sorted(os.listdir(os.path.join(good, "checkpoints",
                                                                                               "step-1")))
    return ok, f"exit {r.returncode}, target kept {sorted(os.listdir(elsewhere))}"


def probe_tampered_meta(tmp):
    """Each bad value in meta.json: resume falls back past it (exit 0, one warning) or test mode refuses it."""
    import json
    good = os.path.join(tmp, "meta-src")
    assert run(cmd(good, "--set", "dist.strategy=none", "--set", "train.save_every=2", "--set", "train.keep_last=5",
                   procs=1, steps=4)).returncode == 0

    def nest(meta):
        return json.dumps(meta)[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}"
    tamper = {"best_step a path outside": ("state", "best_step", "20/../../../outside/step-5"),
              "best_value a string": ("state", "best_value", "0.9"), "epoch 1e30": ("state", "epoch", 1e30),
              "deeply nested JSON": nest}
    results = []
    for name, change in tamper.items():
        out = os.path.join(tmp, "meta", name.replace(" ", "_").replace("/", "_"))
        shutil.copytree(good, out)
        path = os.path.join(out, "checkpoints", "step-4", "meta.json")
        meta = json.load(open(path))
        if callable(change):
            text = change(meta)
        else:
            meta[change[0]][change[1]] = change[2]
            text = json.dumps(meta)
        open(path, "w").write(text)
        t = run(cmd(out, "--set", "dist.strategy=none", "--set", "mode=test", procs=1, steps=6))
        outside = "outside" in t.stdout
        r = run(cmd(out, "--set", "dist.strategy=none", procs=1, steps=6))
        resumed = r.returncode == 0 and "Traceback" not in r.stderr and \
            re.search(r"resumed from \S+/step-2 ", open(os.path.join(out, "logs", "rank0.log")).read())
        results.append((f"meta.json {name}: resume falls back, test never loads it", bool(resumed) and
                        t.returncode in (0, 2) and not outside and "Traceback" not in t.stderr,
                        f"resume exit {r.returncode}, test exit {t.returncode}: {t.stderr.strip()[-150:]}"))
    return results


def probe_bad_csv_rows(tmp):
    rows = {"missing label": b"text,label\na,pos\nno label here\nb,neg\n",
            "empty label": b"text,label\na,pos\nb,neg\nc,\n",
            "unterminated quote": b'text,label\na,pos\n"never closed,neg\nb,pos\n',
            "not UTF-8": b"text,label\na,pos\ncaf\xe9,neg\n",
            "10 MB field": b"text,label\na,pos\n" + b"x" * (10 << 20) + b",neg\n"}
    results = []
    for name, content in rows.items():
        folder = os.path.join(tmp, "csv", name.replace(" ", "_"))
        os.makedirs(folder)
        open(os.path.join(folder, "train.csv"), "wb").write(content)
        open(os.path.join(folder, "dev.csv"), "wb").write(b"text,label\ngood,pos\nbad,neg\n")
        r = run(cmd(os.path.join(folder, "run"), "--set", "dist.strategy=none", "--set", "task=csv_text",
                    "--set", f"data.data_dir={folder}", procs=1, steps=2))
        results.append((f"csv row: {name}", *one_line(r, 2, f"error: {folder}/train.csv:")))
    return results


def probe_oom_killed_rank(tmp):
    out = os.path.join(tmp, "oom")
    p = slow_run(out)
    ranks = ranks_of(p) if wait_log(out, 1, r"step 3/") else []
    if len(ranks) < 2:
        p.kill()
        return False, "did not start"
    ranks[1].kill()  # what the kernel's OOM killer does: SIGKILL, no word from the rank
    r = Finished(p)
    return r.returncode == 1 and "out of memory?" in r.stderr and "Traceback" not in r.stderr, \
        f"exit {r.returncode}: {r.stderr.strip()[-200:]}"


# ---- full disk and read-only folders: tmpfs mounts (root only) ----------------------------------------------
def mount(folder, options):
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", folder], check=True)
    return folder


def fill(folder, leave=0):
    """Fill the tmpfs at `folder` to the last byte, then free `leave` bytes."""
    path = os.path.join(folder, ".filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(path, max(os.path.getsize(path) - leave, 0))


def probe_disks(tmp, mounts):
    """Each case: exit 2, one `error:` line naming the path, and the checkpoints saved before it loadable. `mounts`
    collects the mount points (unmounted by the caller, whatever happens)."""
    lm = ["--set", "task=gpt2_lm", "--set", f"data.data_dir={tmp}/lm", "--set", "data.max_length=16",
          "--set", "model.name=tiny", "--set", "data.tokenizer=char", "--set", "train.best_metric=loss",
          "--set", "train.batch_size=4"]
    os.makedirs(os.path.join(tmp, "lm"))
    open(os.path.join(tmp, "lm", "train.txt"), "w").write("".join(f"ROMEO:\nO speak again {i}\n\n" for i in range(40)))
    one = ["--set", "dist.strategy=none"]

    def at(sub, options):
        return lambda out: mounts.append(mount(os.path.join(out, sub), options))

    def two_pages_left(out):  # output_dir on a full tmpfs but two pages: .lock and the log's first lines
        mounts.append(mount(out, "size=64k"))
        fill(out, leave=8192)

    def trained_then_full(out):  # output_dir on a tmpfs: a run saves its checkpoint, then the disk fills
        mounts.append(mount(out, "size=3m"))
        assert run(cmd(out, *one, procs=1, steps=2)).returncode == 0
        fill(out)

    cases = [  # name, prepare(output_dir), extra arguments, ranks, steps, the path the line must name
        ("TensorBoard folder read-only at start", at("tensorboard", "ro,size=64k"), ["--set", "log.tensorboard=true"],
         1, 4, "tensorboard"),
        ("TensorBoard disk full mid-run", at("tensorboard", "size=8k"), ["--set", "log.tensorboard=true"], 1, 150,
         "tensorboard"),
        ("TensorBoard disk full mid-run, 2 ranks", at("tensorboard", "size=8k"), ["--set", "log.tensorboard=true"],
         2, 150, "tensorboard"),
        ("rank logs disk full mid-run", at("logs", "size=8k"), [], 1, 150, "logs/rank0.log"),
        ("rank logs disk full mid-run, 2 ranks", at("logs", "size=8k"), [], 2, 150, "logs/rank"),
        ("config.yml on a full disk", two_pages_left, [], 1, 4, "config.yml"),
        ("checkpoints/ read-only", at("checkpoints", "ro,size=64k"), [], 1, 4, "checkpoints"),
        ("tokenizer folder read-only (gpt2_lm, char)", at("tokenizer.part", "ro,size=64k"), lm, 1, 2,
         "tokenizer.part"),
        ("dev_results.json on a full disk (test mode)", trained_then_full, ["--set", "mode=test"], 1, 2,
         "dev_results.json"),
    ]
    results = [probe_console_full(tmp, mounts)]
    for name, prepare, extra, procs, steps, names in cases:
        out = os.path.join(tmp, "disk", name.split(" (")[0].replace(" ", "_").replace("/", "_").replace(",", ""))
        os.makedirs(out)
        try:
            prepare(out)
            r = run(cmd(out, "--set", "train.save_every=10", *extra, *(one if procs == 1 else []), procs=procs,
                        steps=steps))
        except Exception as e:  # the drill's own failure: not clean, and the next case still runs
            results.append((name, False, f"the probe failed: {type(e).__name__}: {e}"))
            continue
        ok, seen = one_line(r, 2, os.path.join(out, names))
        ok = ok and r.stderr.startswith("error: ")  # (a path, not always at the start: checkpoints/ at start)
        folder = os.path.join(out, "checkpoints")
        saved = sorted(d for d in os.listdir(folder) if d.startswith("step-")) if os.path.isdir(folder) else []
        intact = all(model_of(out, int(d[5:])) is not None for d in saved)
        results.append((name, ok and intact, f"{seen} (checkpoints: {', '.join(saved) or 'none yet'})"))
    return results


def probe_console_full(tmp, mounts):
    """`python main.py > out.txt` (or SLURM's --output) on a disk that fills: the console's file is named."""
    name = "the console's file (stdout > out.txt) on a full disk"
    folder = os.path.join(tmp, "console")
    mounts.append(mount(folder, "size=4k"))
    out = os.path.join(tmp, "console-run")
    with open(os.path.join(folder, "out.txt"), "w") as stdout:
        r = subprocess.run(cmd(out, "--set", "dist.strategy=none", procs=1, steps=150), cwd=ROOT, env=env(),
                           stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)
    ok, seen = one_line({"stderr": r.stderr, "stdout": "", "returncode": r.returncode}, 2,
                        f"error: {folder}/out.txt: No space left on device")
    return name, ok, seen


# ==============================================================================================================
# Bit flips (issue 33): a byte of a saved file changes; meta.json's sha256 of it says so before anything loads
# ==============================================================================================================
def flip_byte(path):
    """One bit flipped in the middle of the file: in the tensors' bytes, past any header."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))


def bit_flip_probes(tmp, say):
    """For each kind of file: resume (auto) falls back past the flipped checkpoint with one line naming the file
    and ends at exit 0; test mode on it stops with exit 2 and one line; and export, for model.pt."""
    changed = "sha256 differs from meta.json"
    runs = {"none": ["--set", "dist.strategy=none"], "fsdp": ["--set", "dist.strategy=fsdp"]}
    files = [("none", "model.pt"), ("none", "optimizer.pt"), ("none", "state.pt"),
             ("fsdp", "model_dcp/__1_0.distcp")]
    save = ["--set", "train.save_every=2", "--set", "train.keep_last=5"]
    for strategy, extra in runs.items():
        procs = 1 if strategy == "none" else 2
        assert run(cmd(os.path.join(tmp, f"flip-src-{strategy}"), *save, *extra, procs=procs, steps=4)).returncode == 0
    probes = []
    for strategy, name in files:
        procs = 1 if strategy == "none" else 2
        out = os.path.join(tmp, "flip", name.replace("/", "_"))
        shutil.copytree(os.path.join(tmp, f"flip-src-{strategy}"), out)
        step4 = os.path.join(out, "checkpoints", "step-4")
        flip_byte(os.path.join(step4, name))
        t = run(cmd(out, *runs[strategy], "--set", "mode=test", "--set", f"test.checkpoint={step4}", procs=1,
                    steps=6))
        says = f"{step4}/{name}: {changed}"
        probes.append((f"{name} bit flip: test mode refuses in one line", *one_line(t, 2, says)))
        if name == "model.pt":
            e = run(cmd(out, *runs[strategy], "--set", "mode=export", procs=1, steps=6))
            probes.append((f"{name} bit flip: export refuses in one line", *one_line(e, 2, f"{name}: {changed}")))
        r = run(cmd(out, *save, *runs[strategy], procs=procs, steps=6))
        log = open(os.path.join(out, "logs", "rank0.log")).read()
        skips = re.findall(r"resume: skipping \S+, which cannot be loaded: (.*)", log)
        ok = r.returncode == 0 and skips == [f"{step4}/{name}: {changed} (the file changed after it was saved)"] \
            and re.search(r"resumed from \S+/step-2 ", log) is not None and "Traceback" not in r.stderr
        probes.append((f"{name} bit flip: resume falls back to step-2", ok,
                       f"exit {r.returncode}: {' | '.join(skips)[-200:] or r.stderr.strip()[-200:]}"))
    for name, ok, seen in probes:
        say(f"  {'clean' if ok else 'NOT CLEAN'}  {name}: {seen}")
    return probes


# Issue 40: nothing unverified loads, changed values are said, a tracker or a file limit is one line
def issue40_probes(tmp, say):
    """Each probe's outcome as the issue asks it: exit 2 and one line, or a one-line fallback; nothing loaded that
    was not verified, no traceback."""
    def run_with(argv, **environ):
        return subprocess.run(argv, cwd=ROOT, env={**env(), **environ}, capture_output=True, text=True, timeout=300)
    src = os.path.join(tmp, "i40-src")
    save = ["--set", "train.save_every=2", "--set", "train.keep_last=5"]
    assert run(cmd(src, *save, procs=1, steps=4)).returncode == 0

    def copy(name, change):
        out = os.path.join(tmp, "i40", name)
        shutil.copytree(src, out)
        change(os.path.join(out, "checkpoints", "step-4"))
        return out, os.path.join(out, "checkpoints", "step-4")

    def resumed_past(out, step4, says):
        r = run(cmd(out, *save, procs=1, steps=6))
        log = open(os.path.join(out, "logs", "rank0.log")).read()
        ok = r.returncode == 0 and f"skipping {step4}, which cannot be loaded: " in log and says in log and \
            re.search(r"resumed from \S+/step-2 ", log) is not None and "Traceback" not in r.stderr
        return ok, f"exit {r.returncode}: {(re.findall(r'resume: skipping .*', log) or [r.stderr[-200:]])[0][-200:]}"

    def drop_files(d):
        meta = json.load(open(os.path.join(d, "meta.json")))
        meta.pop("files")
        json.dump(meta, open(os.path.join(d, "meta.json"), "w"))
    probes = []
    out, step4 = copy("nometa", lambda d: os.remove(os.path.join(d, "meta.json")))
    t = run(cmd(out, "--set", "mode=test", "--set", f"test.checkpoint={step4}", procs=1))
    probes.append(("meta.json deleted: test mode refuses in one line", *one_line(t, 2, "allow_unverified: true")))
    a = run(cmd(out, "--set", "mode=test", "--set", f"test.checkpoint={step4}", "--set", "allow_unverified=true",
                procs=1))
    probes.append(("meta.json deleted, allow_unverified: test mode loads it, said once",
                   a.returncode == 0 and (a.stdout + a.stderr).count("unverified (allow_unverified: true)") == 1,
                   f"exit {a.returncode}"))
    out, step4 = copy("norecord", drop_files)
    probes.append(("no `files` record: resume falls back to step-2", *resumed_past(out, step4, "no record")))
    out, step4 = copy("symlink", lambda d: os.symlink(os.path.join(d, "..", "step-2"),
                                                      os.path.join(d, "optimizer_dcp")))
    probes.append(("symlinked optimizer_dcp: resume falls back to step-2", *resumed_past(out, step4, "a symlink")))
    key = {"CHECKPOINT_SIGNING_KEY": "drill"}
    signed = os.path.join(tmp, "i40-signed")
    assert run_with(cmd(signed, procs=1, steps=2), **key).returncode == 0
    path = os.path.join(signed, "checkpoints", "step-2")
    flip_byte(os.path.join(path, "model.pt"))
    data = open(os.path.join(path, "model.pt"), "rb").read()
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta["files"]["model.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    t = run_with(cmd(signed, "--set", "mode=test", procs=1), **key)
    probes.append(("signed, weight and hash rewritten: test mode refuses", *one_line(t, 2, "signature does not")))
    m = run_with(cmd(os.path.join(tmp, "i40-mlflow"), "--set", "log.report_to=[mlflow]", procs=1, steps=2),
                 MLFLOW_TRACKING_URI=f"file://{tmp}/mlruns")
    probes.append(("MLFLOW_TRACKING_URI=file://: one line naming mlflow", *one_line(m, 2, "mlflow could not start")))
    n = run(cmd(os.path.join(tmp, "i40-nan"), "--set", "train.optimizer=SGD", "--set",
                "train.optimizer_args={momentum: .nan}", procs=1, steps=2))
    probes.append(("optimizer_args momentum NaN: one line", *one_line(n, 2, "not a finite number")))
    f = run(["prlimit", "--nofile=32", *cmd(os.path.join(tmp, "i40-nofile"), "--set", "train.save_every=5",
                                            procs=2, steps=10)])
    probes.append(("prlimit --nofile=32, 2 ranks: one line naming the limit", *one_line(f, 2, "ulimit -n")))
    for name, ok, seen in probes:
        say(f"  {'clean' if ok else 'NOT CLEAN'}  {name}: {seen}")
    return probes


def issue20_probes(tmp, say):
    """Run every probe, saying each result as it comes; returns [(name, clean, what it saw)]. A probe that fails
    with an exception of its own counts as not clean."""
    probes = []

    def record(results):
        for name, ok, seen in results:
            probes.append((name, ok, seen))
            say(f"  {'clean' if ok else 'NOT CLEAN'}  {name}: {seen}")

    def attempt(name, probe):
        try:
            got = probe(tmp)
        except Exception as e:  # the drill's own failure: said, counted as not clean
            got = (False, f"the probe failed: {type(e).__name__}: {e}")
        record(got if isinstance(got, list) else [(name, *got)])

    attempt("SIGTERM, then 3 more 0.2 s apart while stopping and saving: exit 3, saved", probe_repeated_sigterm)
    attempt("SIGHUP / two runs on one output_dir", probe_sighup_and_second_run)
    attempt("resume at another world size (2 -> 3 ranks, global batch 24) = one process", probe_other_world_size)
    attempt("symlinked checkpoint + keep_last=1: the link's target intact", probe_symlinked_checkpoint)
    attempt("tampered meta.json", probe_tampered_meta)
    attempt("bad csv rows", probe_bad_csv_rows)
    attempt("OOM-killed rank (SIGKILL of rank 1) named 'out of memory?'", probe_oom_killed_rank)
    if os.geteuid() != 0:
        record([("full disk / read-only folders", False, "not run: needs root to mount tmpfs folders")])
        return probes
    mounts = []
    try:
        attempt("full disk / read-only folders", lambda t: probe_disks(t, mounts))
    finally:
        for folder in reversed(mounts):
            subprocess.run(["umount", folder], capture_output=True)
    return probes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kill-trials", type=int, default=12)
    p.add_argument("--signal-trials", type=int, default=2, help="per kind of signal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=["bad", "kill", "signal", "detect", "nan", "issue33", "bitflip", "issue20",
                                                          "issue40"])
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.only = ["bad"]
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="fault-drill-")
    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        t0 = time.monotonic()
        if "bad" in args.only:
            clean, kinds, failures = bad_inputs(tmp, ("unknown key", "changed model size") if args.tiny else ())
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
        if "issue33" in args.only:
            clean, kinds, failures = issue33_inputs(tmp)
            say(f"issue 33 values and files: {clean}/{kinds} end with exit 2 and one `error:` line within 20 s")
            for f in failures:
                say(f"  not clean: {f}")
        if "bitflip" in args.only:
            say("bit flips (issue 33):")
            flips = bit_flip_probes(tmp, say)
            say(f"bit flips: {sum(ok for _, ok, _ in flips)}/{len(flips)} clean")
        if "issue40" in args.only:
            say("issue 40 probes:")
            found = issue40_probes(tmp, say)
            say(f"issue 40 probes: {sum(ok for _, ok, _ in found)}/{len(found)} clean")
        if "issue20" in args.only:
            say("issue 20 probes:")
            probes = issue20_probes(tmp, say)
            say(f"issue 20 probes: {sum(ok for _, ok, _ in probes)}/{len(probes)} clean")
        say(f"drill time {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
