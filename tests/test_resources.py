"""Resources named right (resource_errors.py): a full /dev/shm is shared memory, not the output_dir's disk; running
out of memory is one line naming the step and what to lower; a one-process run killed by SIGKILL (the kernel's
OOM killer, a memory cgroup) is said by its watcher, as the launcher says it of its ranks."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from core import disk_errors
from resilience import faults
from resilience import resource_errors
from conftest import ROOT

RUN = ["--set", "train.epochs=0", "--set", "train.eval_every=0", "--set", "train.save_every=0"]


def raised_in(path: str, error: BaseException) -> BaseException:
    """`error` with a traceback whose frame is in file `path` (where multiprocessing raises its semaphore's)."""
    scope = {}
    exec(compile("def make(e):\n    raise e\n", path, "exec"), scope)
    try:
        scope["make"](error)
    except BaseException as e:
        return e


def test_the_classification_of_resource_errors(monkeypatch):
    monkeypatch.setattr(faults.progress, "step", 12)
    monkeypatch.setattr(faults.progress, "phase", "train")
    nospace = errno.ENOSPC, os.strerror(errno.ENOSPC)
    shm_file = OSError(*nospace, "/dev/shm/torch_1_2")
    semaphore = raised_in("/usr/lib/python3/multiprocessing/synchronize.py", OSError(*nospace))
    torch_shm = RuntimeError("unable to write to file </torch_45_1_0>: No space left on device (28)")
    for e in (shm_file, semaphore, torch_shm):
        line = resource_errors.failure_line(e, "/runs/x")
        assert line.startswith("shared memory (/dev/shm") and "is full at step 12" in line and \
            "data.num_workers" in line and "--shm-size" in line, line
    plain = OSError(*nospace)  # a buffered write's flush in output_dir names no file: still the disk
    assert disk_errors.disk_problem(plain, "/runs/x").startswith("a file in output_dir /runs/x: No space left")
    assert disk_errors.disk_problem(OSError(*nospace, "/runs/x/a.pt"), "/runs/x").startswith("/runs/x/a.pt:")

    allocator = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                             "memory: you tried to allocate 256000000 bytes. Error code 12 (Cannot allocate memory)")
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = MemoryError()
    for e, what in ((MemoryError(), "MemoryError"), (allocator, "RuntimeError: could not allocate 244.1 MiB"),
                    (wrapped, "MemoryError")):
        line = resource_errors.resource_problem(e)
        assert line.startswith(f"out of memory at step 12 ({what})") and "train.batch_size" in line and \
            "model" in line and "data.num_workers" in line, line
    assert resource_errors.resource_problem(ValueError("bad")) is None
    assert resource_errors.resource_problem(plain) is None


def test_one_chain_one_unloadable_and_the_unraisable_hook_installed_once(monkeypatch):
    """Issue 40, item 9: two copies of a class or a function drift apart (an `except` of one misses the other)."""
    from core import checkpoint, errors
    assert resource_errors.chain is disk_errors.chain
    assert getattr(checkpoint, "Unloadable", errors.Unloadable) is errors.Unloadable
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # put back after the test
    monkeypatch.setattr(resource_errors, "_previous_unraisablehook", None, raising=False)
    shm = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/dev/shm/torch_1_2")
    resource_errors.resource_problem(shm)
    installed = sys.unraisablehook
    for _ in range(3):  # each classification used to wrap the hook once more
        resource_errors.resource_problem(shm)
    assert sys.unraisablehook is installed


def run_main(out, *settings, env=None, prefix=(), timeout=300):
    return subprocess.run([*prefix, sys.executable, "main.py", "--set", f"output_dir={out}", *RUN, *settings],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    return lines[0]


@pytest.mark.slow
def test_a_run_that_cannot_allocate_memory_is_one_line(tmp_path):
    """A real allocation failure under `ulimit -v`: a 2-million-unit hidden layer's activations at step 1."""
    r = run_main(tmp_path, "--set", "train.max_steps=2", "--set", "model.hidden=2000000",
                 prefix=("bash", "-c", 'ulimit -v 3000000 && exec "$@"', "ulimit"))
    line = one_error(r)
    assert line.startswith("error: out of memory at step 1 (RuntimeError: could not allocate ") and \
        "lower train.batch_size" in line, line


@pytest.mark.slow
def test_a_full_dev_shm_is_named_as_shared_memory(tmp_path):
    """A private mount namespace (root) with its own 256 KiB /dev/shm, filled: DataLoader workers cannot start."""
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(
            ["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare to give the run its own /dev/shm")
    fill = ("mount -t tmpfs -o size=256k tmpfs /dev/shm && "
            "{ dd if=/dev/zero of=/dev/shm/fill bs=4k count=100 2>/dev/null; true; }")
    r = run_main(tmp_path, "--set", "train.max_steps=2", "--set", "data.num_workers=2",
                 prefix=("unshare", "--mount", "bash", "-c", f'{fill} && exec "$@"', "shm"))
    line = one_error(r)
    assert line.startswith("error: shared memory (/dev/shm: 256.0 KiB, 0 bytes free) is full") and \
        "lower data.num_workers" in line and "output_dir" not in line, line


@pytest.mark.slow
def test_a_one_process_run_killed_by_sigkill_says_so(tmp_path):
    p = subprocess.Popen([sys.executable, "main.py", "--set", f"output_dir={tmp_path}", *RUN, "--set",
                          "train.max_steps=100000", "--set", "train.log_every=1"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log, deadline = tmp_path / "logs" / "rank0.log", time.monotonic() + 120
    while not (log.exists() and "step 3/" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    err = p.stderr.read()  # until the watcher, which holds the pipe too, has written and exited
    assert p.wait() == -signal.SIGKILL
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: the run (pid {p.pid} on {faults.HOST}) was killed ") \
        and "SIGKILL" in lines[0] and f"{log}" in lines[0], err
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    assert step >= 3, lines[0]


def watched(body: str) -> subprocess.CompletedProcess:
    """A process that runs `body` inside resource_errors.reports_a_kill (no torch: a second)."""
    code = ("import os, signal\nfrom resilience import faults, resource_errors\n"
            "with resource_errors.reports_a_kill('/runs/x'):\n"
            "    faults.progress.phase_starts(7, 'train')\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # 4 s: a process that loads torch; quick loop: the watcher's test below
def test_one_rank_of_a_multi_node_run_killed_by_sigkill_says_so(tmp_path):
    # A node that runs one rank of several runs it in its own process, with no launcher above it: the watcher names
    # that rank and its log. (The worker stands in for the Trainer: no torch, no peers.)
    code = ("import os, signal, sys\nimport main\nfrom resilience import faults\nfrom wiring import checked_config\n"
            f"cfg = checked_config(None, ['dist.strategy=ddp', 'dist.nodes=2', 'dist.procs_per_node=[2,1]', "
            f"'dist.node_rank=1', 'dist.master_addr=127.0.0.1', 'output_dir={tmp_path}'])\n"
            "def worker(cfg, place):\n"
            "    faults.progress.phase_starts(5, 'train')\n"
            "    assert place.rank == 2\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "main.start_ranks(cfg, None, worker)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 2 (pid ") and "killed without a word (SIGKILL" in \
        lines[0] and f"at step 5; see {tmp_path}/logs/rank2.log" in lines[0], r.stderr


def test_the_watcher_speaks_only_when_its_process_is_killed():
    killed = watched("os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL
    assert killed.stderr.startswith("error: the run (pid ") and " was killed without a word (SIGKILL" in \
        killed.stderr and "at step 7; see /runs/x/logs/rank0.log" in killed.stderr, killed.stderr
    for body, code in (("pass", 0), ("raise SystemExit(3)", 3), ("raise KeyboardInterrupt", -signal.SIGINT)):
        ended = watched(body)
        assert ended.returncode == code and "killed" not in ended.stderr, ended.stderr


def test_the_watcher_says_what_a_run_that_does_not_train_was_doing():
    # A predict killed by SIGKILL was said `killed ... at step 0`: it has no step.
    code = ("import os, signal\nfrom resilience import faults, resource_errors\n"
            "with resource_errors.reports_a_kill('/runs/x', mode='predict'):\n"
            "    faults.progress.phase_starts(0, 'predict')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert " was killed without a word (SIGKILL" in killed.stderr and \
        "while predicting (mode predict); see /runs/x/logs/rank0.log" in killed.stderr, killed.stderr
