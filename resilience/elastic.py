"""torchrun's restarts: a restartable torchrun whose workers would share the agent's rendezvous store is refused in
one line naming the command to run instead (main.run asks, under torchrun only); train.time_limit counts from the
launch's first start, not anew at each restart (time_used), and a restart after it ran out stops at once
(stop_spent_restart); torchrun exits 1 whatever its workers' exit code, so the launch record keeps theirs
(record_exit) for a script around torchrun that requeues a stopped run (docs/slurm.md, section 4)."""
from __future__ import annotations

import ctypes
import json
import math
import os
import shlex
import signal
import socket
import stat
import sys
import time
from typing import Optional

from core.atomic_write import write_beside
from core.config import parse_duration
from core.launch_env import launcher_env

SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
PR_SET_PDEATHSIG = 1  # prctl's option: a signal for this process when its parent dies
LAUNCH_RECORD = "launch-{host}.json"  # in output_dir/logs: when this node's torchrun first started its workers
PARENT_PID = os.getppid()  # at this process's start: torchrun, for its workers (it may die before they end)


def time_used(output_dir: str, local_rank: int, env=os.environ, now: Optional[float] = None,
              record: bool = True) -> float:
    """Seconds of train.time_limit this torchrun launch used before this start. Its first start (restart count 0)
    used none: local rank 0 records the time with the host and torchrun's pid (unless `record` is False: a rank not
    yet admitted to output_dir, rank_run.py). A restart of the same launch (TORCHELASTIC_RESTART_COUNT > 0, the same
    torchrun on the same host) used the time since; a new command (a deliberate resume, a requeued job) starts the
    limit anew, as does a record that is missing or not this launch's."""
    if "TORCHELASTIC_RESTART_COUNT" not in env:  # not torchrun's worker: nothing restarts it
        return 0.0
    now = time.time() if now is None else now
    path = record_path(output_dir)
    if env["TORCHELASTIC_RESTART_COUNT"] in ("", "0"):
        if local_rank == 0 and record:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_record(path, {**this_launch(), "started": now})
            except OSError:  # (a full disk: a restart then counts the limit anew; the run itself says the disk)
                pass
        return 0.0
    started = (this_launchs_record(path) or {}).get("started")
    if type(started) not in (int, float) or not math.isfinite(started) or not started <= now:
        return 0.0
    return now - started


def record_path(output_dir: str) -> str:
    return os.path.join(output_dir, "logs", LAUNCH_RECORD.format(host=socket.gethostname()))  # (nodes may share it)


def this_launch() -> dict:
    return {"host": socket.gethostname(), "torchrun_pid": PARENT_PID}


def this_launchs_record(path: str) -> Optional[dict]:
    """The launch record at `path` if it is this torchrun's (host and pid), else None."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a symlink would be read outside output_dir; a FIFO blocks
            return None
        with open(path) as f:
            record = json.loads(f.read(4096))  # a few fields: anything longer is not ours
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in this_launch().items()):
        return None
    return record


def write_record(path: str, record: dict) -> None:
    write_beside(path, lambda f: json.dump(record, f))


def record_exit(output_dir: str, local_rank: int, code: Optional[int], env=os.environ) -> None:
    """torchrun exits 1 whatever its workers' exit code (a stop's 3 included): local rank 0 keeps this attempt's in
    the launch record, `"exit": 3`, for a script around torchrun (docs/slurm.md, section 4); None at an attempt's
    start drops the last attempt's, so that a worker killed outright leaves none."""
    if "TORCHELASTIC_RESTART_COUNT" not in env or local_rank != 0:
        return
    path = record_path(output_dir)
    record = this_launchs_record(path)
    if record is None or record.get("exit") == code:
        return
    record.pop("exit", None)
    try:
        write_record(path, record if code is None else {**record, "exit": code})
    except OSError:  # (a full disk: the run itself says it)
        pass


def restarted_after_a_stop(output_dir: str, env=os.environ) -> bool:
    """Whether torchrun restarted this launch's workers after they stopped and saved (the last attempt's exit code
    3 in the launch record): a stop signal sent to them, not to torchrun, which counts the stop as a failure."""
    if env.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        return False
    return (this_launchs_record(record_path(output_dir)) or {}).get("exit") == 3


def stop_spent_restart(cfg, env=os.environ) -> bool:
    """Whether this torchrun restart comes after its launch's train.time_limit ran out (torchrun counts the time
    limit's stop, exit code 3, as a failure, and restarts): it stops at once, training nothing, else each restart
    would train a step, save and stop again until torchrun's restarts are used up. Local rank 0 says it."""
    limit, launch = parse_duration(cfg.train.time_limit), launcher_env()
    if limit is None or cfg.mode not in ("train", "lr_find") or launch is None or launch["launcher"] != "torchrun" \
            or env.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        return False
    output_dir, time_limit, local_rank = cfg.output_dir, cfg.train.time_limit, launch["local_rank"]
    used = time_used(output_dir, local_rank, env)
    if used < limit:
        return False
    if local_rank == 0:
        record_exit(output_dir, local_rank, 3, env)
        print(f"stopped by the time limit (train.time_limit={time_limit}) as torchrun restarted its workers: this "
              f"launch started {used:.0f} s ago; nothing was trained, the latest checkpoint is kept; run the same "
              "command to resume", flush=True)
    else:
        time.sleep(10)  # (torchrun ends it once local rank 0 has said it: one line per node)
    return True


def stop_with_the_agent() -> None:
    """Linux, under torchrun: this worker gets SIGTERM when its torchrun dies (kill -9, the OOM killer, a signal
    torchrun does not handle: SIGUSR1 unless --signals-to-handle names it), so it stops after a step and saves
    instead of training on as an orphan nobody waits for, holding output_dir. (A no-op elsewhere.)"""
    agent = PARENT_PID
    if not torchrun_argv(agent):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != agent:  # torchrun died before prctl took effect: as if the signal had come
        os.kill(os.getpid(), signal.SIGTERM)


def refuse_restarts(local_rank: int) -> bool:
    """Whether this torchrun worker must not run (torchrun_restart_problem): local rank 0 says why; the others
    wait for torchrun to end them (the same line from each would be noise)."""
    problem = torchrun_restart_problem()
    if problem and local_rank == 0:
        print(f"error: {problem}", file=sys.stderr)
    elif problem:
        time.sleep(10)
    return problem is not None


def torchrun_restart_problem(env=os.environ, agent_argv: Optional[list] = None) -> Optional[str]:
    """Why this torchrun cannot restart its workers safely, or None. By default torchrun hands its rendezvous
    store to the workers and keeps it across restarts, with the dead attempt's addresses still in it: a restarted
    worker can read them and hang or fail, using up the restarts (pytorch/pytorch#135712). Only restarts (after
    a failure, or when nodes join or leave: --nnodes=MIN:MAX) are at risk; one attempt is safe."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # (the variable is set: each round has a store of its own)
        return None
    argv = agent_argv if agent_argv is not None else torchrun_argv(os.getppid())
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    nnodes = option(argv, "nnodes") or "1"
    elastic = ":" in nnodes and len(set(nnodes.split(":"))) > 1
    if restarts == 0 and not elastic:
        return None
    why = f"--max-restarts={restarts}" if restarts else f"--nnodes={nnodes}"
    return (f"torchrun {why} restarts its workers, and by default hands them a rendezvous store that keeps the "
            "previous attempt's addresses: a restart can hang or fail on them (pytorch/pytorch#135712). "
            f"Run instead: {safe_torchrun_command(argv)}   (docs/slurm.md, section 4)")


def torchrun_argv(pid: int) -> list:
    """The torchrun agent's arguments (after `torchrun` or `-m torch.distributed.run`), read from /proc; [] when
    they cannot be read (another system, or not started by torchrun)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "torchrun":
            return argv[i + 1:]
        if arg == "-m" and argv[i + 1:i + 2] in (["torch.distributed.run"], ["torch.distributed.launch"]):
            return argv[i + 2:]
    return []


def option(argv: list, name: str) -> Optional[str]:
    """The value of torchrun's option --name (also spelt with `_`, and as `--name value`) in argv, or None."""
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        if arg.endswith(".py"):  # the script: what follows is its own arguments
            break
    return None


def without(argv: list, name: str) -> list:
    """argv less torchrun's option --name and its value."""
    spellings, out, skip = {f"--{name}", f"--{name.replace('-', '_')}"}, [], False
    for arg in argv:
        if skip or arg.partition("=")[0] in spellings:
            skip = arg in spellings and not skip  # `--name value`: the value goes too
            continue
        out.append(arg)
    return out


def safe_torchrun_command(argv: list) -> str:
    """The command to run: the same torchrun with its own store per attempt, and a c10d rendezvous (the static
    one, torchrun's default, shares its store whatever the variable says)."""
    if not argv:
        return f"{SHARED_STORE_FIX} torchrun --rdzv-backend=c10d --rdzv-endpoint=NODE0:29400 ... main.py ..."
    extra = []
    if option(argv, "rdzv-backend") != "c10d" and "--standalone" not in argv:
        argv = without(argv, "rdzv-backend")
        extra = ["--rdzv-backend=c10d"]
        if option(argv, "rdzv-endpoint") is None:
            nodes = option(argv, "nnodes") or "1"
            extra.append("--rdzv-endpoint=" + ("127.0.0.1:29400" if nodes in ("1", "1:1") else "NODE0:29400"))
    return f"{SHARED_STORE_FIX} torchrun {shlex.join(extra + argv)}"
