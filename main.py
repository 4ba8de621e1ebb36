"""Entry point.

    python main.py --params parameters.yml [--set section.key=value ...]

Reads and validates the config (a user mistake exits with code 2 and one line, before any process starts),
then starts one process per device on this node with torch.multiprocessing.spawn, or runs as the single process
that torchrun or SLURM's srun started. Each process builds the task and a Trainer, then trains or tests.
`mode: export` writes a checkpoint for use elsewhere, in this process (export.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import sys
import time
from typing import Optional

from config import Config, UserError, load_config, procs_per_node_list, world_size


def parse_args(argv=None) -> argparse.Namespace:
    # The presets are listed from the folder itself, so that --help names exactly the files a clone has.
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    presets = sorted(f for f in os.listdir(configs) if f.endswith((".yml", ".yaml"))) if os.path.isdir(configs) else []
    epilog = "\n".join([
        "modes (--set mode=...):",
        "  train    train (the default): checkpoints, logs, TensorBoard files and config.yml go to output_dir",
        "  test     evaluate the best checkpoint of output_dir (or test.checkpoint) on the dev and test splits,",
        "           in one process; writes <output_dir>/<split>_results.json",
        "  export   write that checkpoint for use outside this project (export.format; export.dir, by default",
        "           <output_dir>/export)",
        "",
        "presets (--params configs/NAME.yml; each file's first lines say what it needs):",
        *(f"  configs/{name}" for name in presets),
        "",
        "parameters.yml lists the fields you are most likely to change; every field (and its default) is",
        "documented in config.py. An unknown or mistyped field is refused before anything starts.",
        "",
        "examples:",
        "  python main.py --params parameters.yml",
        "  python main.py --set dist.strategy=ddp --set dist.procs_per_node=2",
        "  python main.py --params parameters.yml --set mode=test",
    ])
    p = argparse.ArgumentParser(description="Train, test or export a model as described by a parameters file\n"
                                            "(default: parameters.yml, a CNN on scikit-learn's digits, one process).",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="parameters.yml", help="YAML config (default: parameters.yml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set dist.strategy=ddp (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    keys = {item.split("=", 1)[0].strip(): item.split("=", 1)[-1].strip() for item in args.set}
    if keys.get("train.max_steps", "0") != "0" and "train.epochs" not in keys:
        # A length typed on the command line is the length wanted; the file's epochs must not end the run first.
        args.set.append("train.epochs=0")
        print(f"note: --set train.max_steps={keys['train.max_steps']} without train.epochs: the run lasts "
              f"{keys['train.max_steps']} steps (train.epochs=0; add --set train.epochs=E to keep an epoch limit)")
    try:
        cfg = load_config(args.params, args.set)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def run(cfg: Config) -> int:
    """Start this node's processes and wait for them. Returns the exit code (see faults.py: 0 finished, 1 crash,
    2 user error, 3 stopped by a signal or the time limit after saving, 4 diverged)."""
    from distributed import launcher_env

    if cfg.mode == "export":  # one process, no process group: a checkpoint in, a folder out (export.py)
        return run_export(cfg)
    if cfg.mode == "test":  # test mode always runs in one process, whatever trained the checkpoint
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="none", tp=1, nodes=1,
                                                                procs_per_node=1, node_rank=0))
    env = launcher_env()
    lock = contextlib.nullcontext()
    try:
        check_output_dir(cfg.output_dir)
        first = cfg.dist.node_rank == 0 if env is None else env["rank"] == 0
        if cfg.mode == "train" and first:
            lock = hold_output_dir(cfg.output_dir)
        if env is None:
            check_port_free(cfg)
    except UserError as e:
        lock.__exit__(None, None, None)
        print(f"error: {e}", file=sys.stderr)
        return 2
    with lock:  # held until this run ends, however it ends
        if env is not None:  # torchrun / srun started us: we are exactly one rank
            return worker(cfg, Launch(env["rank"], env["local_rank"], env["world_size"], env["local_world_size"],
                                      env["rendezvous"]))
        procs = procs_per_node_list(cfg)
        here, first_rank, world = procs[cfg.dist.node_rank], sum(procs[: cfg.dist.node_rank]), sum(procs)
        if here == 1:
            return worker(cfg, Launch(first_rank, 0, world, 1))
        return supervise(cfg, here, first_rank, world)


@dataclasses.dataclass
class Launch:
    """Where one process sits among the ranks: what worker() needs besides the config."""
    rank: int                         # global rank
    local_rank: int                   # rank among the processes of this node (picks the GPU)
    world: int                        # ranks in all, every node
    local_procs: int                  # ranks on this node: they share its cores (see worker's thread count)
    rendezvous: Optional[str] = None  # where ranks meet: env:// under torchrun; None: from cfg.dist


def run_export(cfg: Config) -> int:
    """mode: export. Under torchrun or srun, rank 0 alone writes the folder."""
    import export as exporter
    from distributed import launcher_env
    env = launcher_env()
    if env is not None and env["rank"] != 0:
        return 0
    try:
        exporter.run(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def check_output_dir(path: str) -> None:
    """A mistake here would otherwise surface as a traceback from every rank, or at the first save."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"output_dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"output_dir {path!r} is not a writable directory ({e.strerror})") from None


def hold_output_dir(path: str):
    """One run per output_dir: an exclusive lock on output_dir/.lock for as long as this process lives (the
    kernel drops it when the process ends, however it ends, so a lock is never stale). A second run is refused
    in one line naming the holder; two runs in one folder would resume, save and prune each other's steps."""
    import fcntl
    import socket
    f = open(os.path.join(path, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"output_dir {path!r} is in use by another run ({holder}); wait for it to end, or use "
                        "another output_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def check_port_free(cfg: Config) -> None:
    """Node 0 hosts the rendezvous on master_addr:master_port. If another program (often another run) holds the
    port, say so before starting, with the fix, instead of a timeout or a traceback from inside torch."""
    import socket
    d = cfg.dist
    if d.strategy in ("none", "dp") or d.node_rank != 0 or d.init_method != "tcp" or \
            (cfg.mode == "test") or world_size(cfg) == 1:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does: TIME_WAIT is no conflict
        try:
            s.bind((d.master_addr or "127.0.0.1", d.master_port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"dist.master_port {d.master_port} is already in use on this machine (another "
                                f"run?); pick a free one, e.g. --set dist.master_port={d.master_port + 1}") from None
            # EADDRNOTAVAIL: master_addr names another machine; nothing to check from here


# ==============================================================================================================
# Our own launcher: one process per device, watched
# ==============================================================================================================
GRACE_S = 2.0  # after a rank fails, how long the others get to report before they are killed
EXIT_GRACE_S = 60.0  # a rank that is done may take this long (at most dist.hang_timeout_s) to tear down and exit


def supervise(cfg: Config, nprocs: int, first_rank: int, world: int) -> int:
    """Start `nprocs` ranks and watch them. Unlike torch.multiprocessing.spawn, this says which rank failed and
    how: each rank leaves its last word in a report file, a rank that died without one is named with its signal
    or exit code and the step it was at, and identical lines from several ranks are printed once. Signals sent
    to this process (Ctrl-C, SIGTERM, SIGHUP, the stop signal) are passed on to every rank, which stop together
    after saving; the same signals again while stopping print a line and change nothing (faults.StopRequest):
    SIGKILL to this process ends the run at once. A failed rank takes the others down within GRACE_S seconds; if
    this process is killed, even with -9, the ranks die with it (faults.set_parent_death_signal). A rank that is
    done (results saved) but whose teardown hangs (a process group that will not close, say) is ended after
    EXIT_GRACE_S, or crashes (gloo can abort at exit), with a warning, and counts with the exit code it finished
    with."""
    import multiprocessing as mp
    import shutil
    import signal
    import tempfile
    from multiprocessing.connection import wait
    from faults import HOST, already_stopping, detach_hung_up_terminal, stop_signals

    mpc = mp.get_context("spawn")
    steps = mpc.Array("q", nprocs, lock=False)  # each rank's current step, readable after it died
    finished = mpc.Array("i", [-1] * nprocs, lock=False)  # each rank's exit code once it is done (before teardown)
    procs, report_dir = [], None
    exit_grace = min(EXIT_GRACE_S, cfg.dist.hang_timeout_s) or EXIT_GRACE_S
    done_at, stuck = {}, {}  # rank index -> when it was done; -> its exit code if its teardown hung or crashed
    signals_seen, said_again, kill_at, exit_order = [], 1, None, []

    def teardown_failed(i: int) -> bool:  # done, then ended by anything but its own return (we never SIGKILL a
        p = procs[i]                      # rank that is done, unless its teardown hangs or another rank failed)
        return finished[i] >= 0 and p.exitcode not in (None, finished[i], -signal.SIGKILL)

    def forward(signum, frame):  # the ranks run in their own process group: only we hear the terminal's Ctrl-C
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        signals_seen.append(signum)  # (the loop below says a repeat: no printing inside a signal handler)
        for p in procs:
            if p.pid and p.exitcode is None:
                os.kill(p.pid, signum)

    signums = [getattr(signal, n) for n in stop_signals(cfg.train.stop_signal)]
    previous = {n: signal.signal(n, forward) for n in signums}
    try:
        report_dir = tempfile.mkdtemp(prefix="trainer-reports-")  # (removed in `finally`, whichever signal came)
        procs.extend(mpc.Process(target=_spawned_worker, name=f"rank{first_rank + i}",
                                 args=(cfg, Launch(first_rank + i, i, world, nprocs), report_dir, steps, finished,
                                       os.getpid()))
                     for i in range(nprocs))
        # The ranks start with the stop signals blocked (the mask is inherited) and unblock them once their
        # handlers are in (faults.StopRequest.install): a signal forwarded while a rank starts up waits till then.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
        try:
            with environment(rank_environment(cfg, nprocs)):  # spawn: each rank starts with this environment
                for p in procs:
                    p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        while True:
            for signum in signals_seen[said_again:]:  # the ranks go on with their save
                print(already_stopping(signal.Signals(signum).name, os.getpid()), flush=True)
            said_again = max(said_again, len(signals_seen))
            alive = [p for p in procs if p.exitcode is None]
            for i, p in enumerate(procs):
                if p.exitcode is not None and p not in exit_order:
                    exit_order.append(p)
                if teardown_failed(i):
                    stuck[i] = finished[i]  # crashed after it was done (a C++ abort closing gloo, say)
            if not alive:
                break
            for i, p in enumerate(procs):
                if p.exitcode is None and finished[i] >= 0 and i not in stuck:
                    if time.monotonic() - done_at.setdefault(i, time.monotonic()) > exit_grace:
                        stuck[i] = finished[i]
                        p.kill()
            failed = [p for p in exit_order if stuck.get(procs.index(p), p.exitcode) not in (0, 3)]
            if failed and kill_at is None:
                kill_at = time.monotonic() + GRACE_S
            if kill_at is not None and time.monotonic() >= kill_at:
                for p in alive:
                    p.kill()
            wait([p.sentinel for p in alive], timeout=0.5)
        for p in procs:
            p.join()
        for i, code in stuck.items():
            p = procs[i]
            if p.exitcode == -signal.SIGKILL:
                what = f"still tearing down {exit_grace:.0f} s later; ended it"
            elif code in (0, 3):  # (after a failure, its report says what matters)
                what = "its teardown ended with " + (signal.Signals(-p.exitcode).name if p.exitcode < 0 else
                                                     f"exit code {p.exitcode}") + "; counted as done"
            else:
                continue
            print(f"warning: rank {first_rank + i} on {HOST} (pid {p.pid}) was done (exit code {code}) but {what}",
                  file=sys.stderr, flush=True)
        return summarize(procs, exit_order, first_rank, report_dir, steps, stuck)
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:  # pid None: never started (p.start() itself failed)
                p.kill()
        if report_dir is not None:
            shutil.rmtree(report_dir, ignore_errors=True)
        for n, handler in previous.items():
            signal.signal(n, handler)


def rank_environment(cfg: Config, nprocs: int) -> dict:
    """What the ranks' environment needs on top of ours. OpenMP threads waiting for work spin by default (GNU
    OpenMP: for a while, then sleep); several CPU ranks on one host then spin on the cores the others need: two
    MiniLM ranks with 2 threads each on a loaded 2-core machine ran at 0.6 samples/s, 11 with PASSIVE
    (benchmarks/RESULTS.md, "OpenMP waiting"). OMP_WAIT_POLICY=PASSIVE makes idle threads sleep. OpenMP reads it
    once, when torch loads it, so it must be in the environment a rank starts with. A value you set is kept; GPU
    ranks keep OpenMP's default."""
    from distributed import pick_device_type
    if nprocs < 2 or "OMP_WAIT_POLICY" in os.environ or pick_device_type(cfg.dist.device) != "cpu":
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def environment(extra: dict):
    """os.environ with `extra` set, for processes started inside the block; restored after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(procs, exit_order, first_rank: int, report_dir: str, steps, stuck: dict) -> int:
    """Print each distinct final word once; return the exit code of the first rank that failed (else 0/3).
    `stuck`: ranks whose teardown hung (ended by us) or crashed, with the exit code they were done with."""
    import json
    import signal
    from faults import EXIT_CRASH, HOST, say
    reports = {}
    for i, p in enumerate(procs):
        path = os.path.join(report_dir, f"rank{first_rank + i}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[i] = json.load(f)
    exitcode = {p: stuck.get(i, p.exitcode) for i, p in enumerate(procs)}
    first_failed = next((p for p in exit_order if exitcode[p] not in (0, 3)), None)
    said = set()
    for i, p in sorted(enumerate(procs), key=lambda ip: reports.get(ip[0], {}).get("time", float("inf"))):
        rank = first_rank + i
        if i in reports:
            code, line, detail = reports[i]["code"], reports[i]["line"], reports[i]["detail"]
        elif exitcode[p] and exitcode[p] < 0:
            if first_failed is not None and p is not first_failed and p.exitcode == -signal.SIGKILL:
                continue  # killed by us, after another rank failed
            # The kernel's OOM killer sends SIGKILL, and a rank that runs out of memory leaves no report.
            oom = " (killed by the kernel: out of memory?, or kill -9)" if p.exitcode == -signal.SIGKILL else ""
            code, line, detail = EXIT_CRASH, (f"rank {rank} on {HOST} (pid {p.pid}) died from "
                                              f"{signal.Signals(-p.exitcode).name}{oom} at step {steps[i]}"), ""
        elif exitcode[p]:
            code, line, detail = EXIT_CRASH, (f"rank {rank} on {HOST} (pid {p.pid}) exited with code {p.exitcode} "
                                              f"at step {steps[i]} without a report (see logs/rank{rank}.log)"), ""
        else:
            continue
        if line not in said:  # the same final word from several ranks: once
            said.add(line)
            say(code, line, detail)
    if first_failed is None:
        return max(exitcode.values())  # 0, or 3 when stopped
    i = procs.index(first_failed)
    return reports[i]["code"] if i in reports else 1


def _spawned_worker(cfg, launch: Launch, report_dir, steps, finished, parent_pid) -> None:
    import faults
    faults.set_parent_death_signal(parent_pid)
    os.setpgrp()  # out of the terminal's process group: one Ctrl-C reaches us once, forwarded by supervise()
    faults.progress.shared, faults.progress.slot, faults.progress.codes = steps, launch.local_rank, finished
    faults.report.report_dir = report_dir
    if cfg.mode != "train":  # (train mode unblocks the stop signals once its handlers are in: StopRequest.install)
        import signal
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, n)
                                                    for n in faults.stop_signals(cfg.train.stop_signal)])
    leave(worker(cfg, launch))


def leave(code: int) -> None:
    """End a rank's process with `code`, skipping the interpreter's teardown: by now its results are saved, its
    logs flushed and its process group closed, but not freed: torch still holds the group, so gloo's worker
    threads live on, and one still freeing the tensors of a last collective while Python tears down aborts the
    process after the run was done (SIGABRT, "terminate called without an active exception"; benchmarks/
    RESULTS.md, "A rank aborting after the run was done")."""
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker(cfg: Config, launch: Launch) -> int:
    """One rank: join the group, build task and Trainer, train or test. Returns the exit code; whatever goes
    wrong is reported once (faults.report), naming this rank, its host and the step."""
    import faults
    from faults import HOST, report

    rank = launch.rank
    faults.progress.rank = rank
    # Libraries' download and loading bars are for terminals; in log files they are noise (read at import).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if cfg.mode == "train":
        faults.stop_request.install(cfg.train.stop_signal, faults.parse_duration(cfg.train.time_limit))
    ctx = watchdog = None
    try:
        import distributed as D
        from tasks import build_task
        from run_log import setup_logging
        from trainer import Trainer

        log = report.log = setup_logging(cfg.output_dir, rank)
        log.info(f"rank {rank} on {HOST}: pid {os.getpid()}, local rank {launch.local_rank} of "
                 f"{launch.local_procs}, {launch.world} ranks in all, {cfg.mode}", extra={"file_only": True})
        faults.stop_request.log = log
        ctx = D.init(cfg, rank, launch.world, launch.local_rank, launch.rendezvous)
        ctx.cpu_threads = D.share_cores(ctx, launch.local_procs)  # the plan prints what it chose
        watchdog = faults.Watchdog.start(cfg, ctx)
        if watchdog is not None:
            report.store = watchdog.store
        trainer = Trainer(cfg, build_task(cfg), ctx)
        trainer.test() if cfg.mode == "test" else trainer.train()
        faults.progress.at(faults.progress.step, "done")
        D.barrier(ctx)  # all ranks finish before any closes its connections (else gloo can abort at exit)
        code = faults.EXIT_OK
    except UserError as e:
        code = report(faults.EXIT_USER_ERROR, f"error: {e}")
    except (faults.Stopped, faults.Diverged) as e:  # every rank raised it at the same step
        code = report(e.exit_code, str(e))
    except KeyboardInterrupt:  # test mode, or before the handlers were installed
        code = report(130, f"rank {rank} on {HOST}: interrupted {faults.progress.where()}")
    except BaseException as e:  # a crash: never lost, never silent
        code = faults.crash_report(e, watchdog)
    if watchdog is not None:
        watchdog.stop()
    faults.progress.finished(code)
    # Tear the group down after a clean end, or when there are no peers; after a failure, peers may be gone and
    # tearing down could wait on them (the launcher ends this process instead).
    if ctx is not None and (code in (faults.EXIT_OK, faults.EXIT_STOPPED, faults.EXIT_DIVERGED)
                            or ctx.world_size == 1):
        D.shutdown(ctx)
    return code


if __name__ == "__main__":
    code = main()
    from distributed import launcher_env
    if launcher_env() is not None:  # torchrun or srun started this process as one rank: it ends as ours do
        leave(code)
    sys.exit(code)
