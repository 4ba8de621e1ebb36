"""Entry point.

    python main.py --params parameters.yml [--set section.key=value ...]

Reads and checks the config (a mistake: one line, exit code 2, before any process starts; torch is not loaded
yet), then starts this node's ranks (launcher.py) or is the one rank torchrun or srun started. Each rank builds
the task and a Trainer, then trains or tests; `mode: export` writes a checkpoint in this process (export.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import os
import socket
import sys
import threading
import time
from typing import Optional

import faults
from config import Config, UserError, load_config, procs_per_node_list
from faults import HOST, report
from resource_errors import reports_a_kill


class Parser(argparse.ArgumentParser):
    def format_help(self) -> str:  # the modes, presets and examples: loaded only by --help
        from cli_help import epilog
        self.epilog = epilog()
        return super().format_help()


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description="Train, test or export a model as described by a parameters file\n"
                           "(default: parameters.yml, a CNN on scikit-learn's digits, one process).",
               formatter_class=argparse.RawDescriptionHelpFormatter)
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
    """Start this node's processes and wait for them. Returns the exit code (faults.EXIT_*)."""
    from distributed import launcher_env

    env = launcher_env()
    if cfg.mode == "test":  # test mode always runs in one process, whatever trained the checkpoint
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="none", tp=1, nodes=1,
                                                                procs_per_node=1, node_rank=0))
    if env is not None and env["launcher"] == "torchrun" and cfg.mode != "export":
        import elastic  # (only torchrun's workers load it)
        if elastic.refuse_restarts(env["local_rank"]):
            return 2
    try:
        if cfg.mode == "export":  # one process, no process group: a checkpoint in, a folder out
            import export
            if env is None or env["rank"] == 0:  # under torchrun or srun, rank 0 alone writes the folder
                return export.main(cfg)  # 0, or 130 after Ctrl-C
            return 0
        check_output_dir(cfg.output_dir)
        first = cfg.dist.node_rank == 0 if env is None else env["rank"] == 0
        with hold_output_dir(cfg.output_dir) if cfg.mode == "train" and first else contextlib.nullcontext():
            return start(cfg, env)  # the lock is held until this run ends, however it ends
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def start(cfg: Config, env: Optional[dict]) -> int:
    """Be the one rank that torchrun or srun started, or start this node's ranks."""
    if env is not None:
        return worker(cfg, Launch(env["rank"], env["local_rank"], env["world_size"], env["local_world_size"],
                                  env["rendezvous"]))
    procs = procs_per_node_list(cfg)
    here, first_rank, world = procs[cfg.dist.node_rank], sum(procs[: cfg.dist.node_rank]), sum(procs)
    launches = [Launch(first_rank + i, i, world, here) for i in range(here)]
    if world == 1:
        with reports_a_kill(cfg.output_dir):  # no launcher above this process to say that it was killed
            return worker(cfg, launches[0])
    import launcher  # here: a one-process run (and each rank) never needs the launcher
    launcher.check_port_free(cfg)
    return worker(cfg, launches[0]) if here == 1 else launcher.Supervisor(cfg, launches).run()


@dataclasses.dataclass
class Launch:
    """Where one process sits among the ranks: what worker() needs besides the config."""
    rank: int                         # global rank
    local_rank: int                   # rank among the processes of this node (picks the GPU)
    world: int                        # ranks in all, every node
    local_procs: int                  # ranks on this node: they share its cores (see worker's thread count)
    rendezvous: Optional[str] = None  # where ranks meet: env:// under torchrun; None: from cfg.dist


def check_output_dir(path: str) -> None:
    """A mistake here would otherwise surface as a traceback from every rank, or at the first save."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"output_dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"output_dir {path!r} is not a writable directory ({e.strerror})") from None
    # checkpoints/ too, if there: a read-only one would otherwise be found at the first save, hours later
    for folder in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(folder):
            try:
                probe = os.path.join(folder, f".write-test-{os.getpid()}")
                with open(probe, "w"):
                    pass
                os.remove(probe)
            except OSError as e:
                name = "output_dir" if folder == path else "checkpoint folder"
                raise UserError(f"{name} {folder!r} is not a writable directory ({e.strerror}): make it writable "
                                f"for this run, or choose another output_dir") from None


def hold_output_dir(path: str):
    """One run per output_dir: an exclusive lock on output_dir/.lock for as long as this process lives (the
    kernel drops it when the process ends, however it ends, so a lock is never stale). A second run is refused
    in one line naming the holder; two runs in one folder would resume, save and prune each other's steps."""
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


def worker(cfg: Config, launch: Launch) -> int:
    """One rank: join the group, build task and Trainer, train or test. Returns the exit code; whatever goes
    wrong is reported once (faults.report), naming this rank, its host and the step."""
    rank = launch.rank
    faults.progress.rank = rank
    threading.excepthook = faults.thread_exception  # a writer thread's full disk: one line, from the main thread
    faults.no_stdin()  # no prompt can wait on, or be answered from, the terminal
    # Libraries' download and loading bars are for terminals; in log files they are noise (read at import).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if cfg.mode == "train":
        faults.stop_request.install(cfg.train.stop_signal, faults.parse_duration(cfg.train.time_limit))
    ctx = watchdog = None
    try:
        import distributed as D  # (torch loads here: see the top of this file)
        from tasks import build_task
        from run_log import setup_logging
        from trainer import Trainer

        log = report.log = setup_logging(cfg.output_dir, rank)
        log.info(f"rank {rank} on {HOST}: pid {os.getpid()}, local rank {launch.local_rank} of "
                 f"{launch.local_procs}, {launch.world} ranks in all, {cfg.mode}", extra={"file_only": True})
        faults.stop_request.log = log
        ctx = D.init(cfg, rank, launch.world, launch.local_rank, launch.rendezvous)
        ctx.cpu_threads = D.share_cores(ctx, launch.local_procs)  # the plan prints what it chose
        watchdog = faults.start_watchdog(cfg, ctx)  # several ranks only
        trainer = Trainer(cfg, build_task(cfg), ctx)
        trainer.test() if cfg.mode == "test" else trainer.train()
        faults.progress.at(faults.progress.step, "done")
        D.barrier(ctx)  # all ranks finish before any closes its connections (else gloo can abort at exit)
        code = faults.EXIT_OK
    except UserError as e:
        code = faults.user_error(f"error: {e}", watchdog)
    except (faults.Stopped, faults.Diverged) as e:  # every rank raised it at the same step
        code = report(e.exit_code, str(e))
    except KeyboardInterrupt:  # test mode, or before the handlers were installed
        code = report(130, f"rank {rank} on {HOST}: interrupted {faults.progress.where()}")
    except BaseException as e:  # a crash: never lost, never silent; a full disk or read-only folder is one line
        from disk_errors import disk_problem  # (loaded only when something failed)
        line = disk_problem(e, cfg.output_dir)
        code = faults.user_error(f"error: {line}", watchdog) if line else faults.crash_report(e, watchdog)
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
    faults.ignore_late_signals = True
    code = main()
    # torchrun or srun started this process as one rank: it ends as ours do. (A run that stopped at a mistake in
    # its config never loaded distributed, nor torch: it ends at once.)
    if "distributed" in sys.modules and sys.modules["distributed"].launcher_env() is not None:
        import launcher
        launcher.leave(code)
    sys.exit(code)
