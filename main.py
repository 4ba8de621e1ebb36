"""Entry point.

    python main.py --params parameters.yml [--set section.key=value ...]

The composition root's first half (where the parts are built and connected): this process. In the order a run goes
(the path of one training step, file by file, is docs/tutorial/02_ddp.md, "Following one step through the files"):
1. main(): read and check the config; a mistake is one line and exit code 2, before torch loads.
2. run(): hold output_dir, then start_ranks(): under torchrun or srun this process is one rank; otherwise it starts
   this node's ranks (resilience/launcher.py), each a process running wiring.worker.
3. wiring.worker, in each rank: the process group, build_trainer (the model wrapped by its strategy: DDP in
   strategies/replicated.py), then Trainer.train() (trainer.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from typing import Callable, Optional

from core import process_end, trackers
from core.config import Config, config_source, procs_per_node_list, read_config
from core.errors import UserError
from core.launch_env import first_on_node, launcher_env
from extras import dev_run
from extras.cli_help import epilog
from resilience import elastic, faults, launcher
from resilience.resource_errors import reports_a_kill
from resilience.run_dir_lock import check_output_dir, hold_output_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = read_config(args.params, args.set)  # the schema's own checks: instant, torch is not loaded
        dev = args.dev_run or cfg.train.dev_run
        faults.listen(cfg.mode, cfg.train.stop_signal, dev_run=dev)  # which signals stop this run, and how
        if elastic.stop_spent_restart(cfg):  # a torchrun restart after train.time_limit ran out: it trains nothing
            return 3
        if faults.stop_request.reason:  # a stop signal as main.py started (catch_early): nothing to load or save
            return faults.stopped_before_start(faults.stop_request.reason)
        import wiring  # torch, every strategy and task (seconds): loaded once the schema's mistakes are said
        wiring.check(cfg, config_source(args.params, args.set))  # the keys each strategy, task, launcher reads
    except UserError as e:
        return mistake(e)
    except KeyboardInterrupt as e:  # (a run that does not train: its ranks say it themselves once they started)
        return faults.interrupted(e, cfg.mode)
    if faults.stop_request.reason:  # (one that came while torch loaded)
        return faults.stopped_before_start(faults.stop_request.reason)
    if args.length_note and file_limits(args):  # said once the config holds: a mistake is one line
        print(args.length_note)
    if dev:
        return dev_run.run(os.path.abspath(__file__), args.params, args.set, cfg.output_dir,
                           exports=bool(wiring.TASKS[cfg.task].export_formats), smaller=dev_run.shrunk(cfg),
                           nodes=cfg.dist.nodes)
    return run(cfg)


def run(cfg: Config) -> int:
    """Start this node's processes and wait for them. Returns the exit code (core/errors.py's EXIT_*)."""
    import wiring  # (as in main(): what a rank runs; the tests call run() with a config checked by wiring)
    env = launcher_env()  # torchrun's or srun's rank; None: a plain `python main.py`, which starts its ranks
    # test runs in one process, whatever trained the checkpoint; predict too, unless it shares the inputs under ddp
    if cfg.mode == "test" or (cfg.mode == "predict" and cfg.dist.strategy != "ddp"):
        cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="none", tp=1, nodes=1,
                                                                procs_per_node=1, node_rank=0))
    if env is not None and env["launcher"] == "torchrun" and cfg.mode != "export":
        elastic.stop_with_the_agent()
        if elastic.refuse_restarts(env["local_rank"]):
            return 2
    try:
        if cfg.mode == "export":  # one process, no process group: a checkpoint in, a folder out
            if env is None or env["rank"] == 0:  # under torchrun or srun, rank 0 alone writes the folder
                return wiring.run_export(cfg)  # 0, or 130 after Ctrl-C
            return 0
        check_output_dir(cfg.output_dir)
        first = cfg.dist.node_rank == 0 if env is None else env["rank"] == 0
        holds_the_lock = cfg.mode in ("train", "lr_find", "predict") and first  # one run (predict) per output_dir
        try:
            lock = hold_output_dir(cfg.output_dir, "predict" if cfg.mode == "predict" else "run") \
                if holds_the_lock else contextlib.nullcontext()
        except UserError as e:  # (the ranks nothing ends, srun's or other nodes', hear it at the roll call)
            code = mistake(e)
            wiring.refuse_the_other_ranks(cfg, env, str(e))
            return code
        with lock:
            return start_ranks(cfg, env, wiring.worker)  # the lock is held until this run ends, however it ends
    except UserError as e:
        return mistake(e)
    except KeyboardInterrupt as e:  # a run that does not train, before its rank started or its export began
        return faults.interrupted(e, cfg.mode)


QUIET_WAIT_S = 10.0  # how long a rank that leaves the line to its node's first rank waits before exiting


def mistake(e: UserError) -> int:
    """A user mistake found before the ranks meet: one line, said by the first rank of each node under torchrun or
    srun; exit code 2. The others wait a moment: torchrun ends every rank once one exits, maybe before it is said."""
    if first_on_node():
        print(f"error: {e}", file=sys.stderr)
    else:
        time.sleep(QUIET_WAIT_S)
    return 2


@dataclasses.dataclass
class RankPlace:
    """Where one process sits among the ranks: what wiring.worker() needs besides the config."""
    rank: int                         # global rank
    local_rank: int                   # rank among the processes of this node (picks the GPU)
    world: int                        # ranks in all, every node
    local_procs: int                  # ranks on this node: they share its cores (see worker's thread count)
    rendezvous: Optional[str] = None  # where ranks meet: env:// under torchrun; None: from cfg.dist


def start_ranks(cfg: Config, env: Optional[dict], worker: Callable[[Config, RankPlace], int]) -> int:
    """Be the one rank that torchrun or srun started, or start this node's ranks (`worker`: wiring.worker)."""
    if env is not None:
        if env["launcher"] == "slurm":  # srun's ranks meet where cfg.dist says (torchrun's env:// is torchrun's own)
            launcher.check_srun_rendezvous(cfg, env["rank"])
        return worker(cfg, RankPlace(rank=env["rank"], local_rank=env["local_rank"], world=env["world_size"],
                                     local_procs=env["local_world_size"], rendezvous=env["rendezvous"]))
    procs = procs_per_node_list(cfg)
    here, first_rank, world = procs[cfg.dist.node_rank], sum(procs[: cfg.dist.node_rank]), sum(procs)
    places = [RankPlace(rank=first_rank + i, local_rank=i, world=world, local_procs=here) for i in range(here)]
    launcher.check_rendezvous(cfg, world)
    if here > 1:  # one process per rank, each running launcher.rank_main, then worker(cfg, its place)
        return launcher.Supervisor(cfg, places, worker).supervise()
    # One process on this node (the run's only one, or one rank of a multi-node run): no launcher above it to say
    # that it was killed, nor to end the tracked runs rank 0 left open.
    after_a_kill = (lambda say: trackers.end_runs_left_running(cfg, say)) if first_rank == 0 else None
    with reports_a_kill(cfg.output_dir, rank=None if world == 1 else first_rank, after_a_kill=after_a_kill,
                        mode=cfg.mode):
        return worker(cfg, places[0])


# ---- the command line ------------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def format_help(self) -> str:  # the modes, presets and examples of this clone
        self.epilog = epilog()
        return super().format_help()


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description="Train, test or export a model as described by a parameters file\n"
                           "(default: parameters.yml, a CNN on scikit-learn's digits, one process).",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="parameters.yml", help="YAML config (default: parameters.yml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set dist.strategy=ddp (repeatable)")
    p.add_argument("--dev-run", action="store_true",
                   help="after an edit: every stage (train, evaluate, save, resume, test, export) for a step or two, "
                        "in a temporary folder (train.dev_run)")
    args = p.parse_args(argv)
    keys = {item.split("=", 1)[0].strip(): item.split("=", 1)[-1].strip() for item in args.set}
    args.length_note = None
    # A length typed on the command line is the length wanted: the file's other limit must not end the run first.
    for typed, other, unit, keep in (("max_steps", "epochs", "steps", "train.epochs=E to keep an epoch limit"),
                                     ("epochs", "max_steps", "epochs", "train.max_steps=N to keep a step limit")):
        if keys.get(f"train.{typed}", "0") != "0" and f"train.{other}" not in keys:
            args.set.append(f"train.{other}=0")
            args.length_note = (f"note: --set train.{typed}={keys[f'train.{typed}']} without train.{other}: the run "
                                f"lasts {keys[f'train.{typed}']} {unit} (train.{other}=0; add --set {keep})")
            break
    return args


def file_limits(args: argparse.Namespace) -> bool:
    """Whether the parameters file (or preset) has the limit that the override parse_args appended lifts
    (train.epochs=0 or train.max_steps=0): where it is already 0, the note would say nothing."""
    key = args.set[-1].split("=", 1)[0].removeprefix("train.")
    try:  # the config as read without that last override (instant: no torch)
        return getattr(read_config(args.params, args.set[:-1]).train, key) != 0
    except UserError:  # the file's value is one only the appended 0 made valid: the note says what replaced it
        return True


if __name__ == "__main__":
    faults.stop_request.catch_early()  # first: a stop signal as main.py starts is a stop (exit 3), not death by it
    faults.ignore_late_signals = True
    code = main()
    # Whatever loaded torch (a rank torchrun or srun started, the one process of a run, the launcher of this node's
    # ranks) ends as our ranks do. A run that stopped at a mistake in its config never loaded torch: it ends at once.
    if "torch" in sys.modules:
        process_end.end_process(code)
    sys.exit(code)
