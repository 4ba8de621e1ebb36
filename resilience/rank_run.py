"""One rank's run, from its start to its exit code (wiring.worker runs inside it): what a rank sets up before it
joins the process group, and whatever ends it (the end of the run, a stop, a user mistake, a crash) reported once,
naming the rank, its host and the step, then the group torn down where that cannot hang. Rules: docs/faults.md."""
from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import threading
import time
import traceback
from typing import Optional

import torch.distributed

from core import config, distributed, process_group
from core.config import Config
from core.errors import EXIT_CRASH, EXIT_DIVERGED, EXIT_OK, EXIT_STOPPED, Diverged, Stopped, UserError, first_line
from core.launch_env import launcher_env
from core.run_log import setup_logging
from resilience import elastic, faults, heartbeat, resource_errors
from resilience.faults import HOST, report

WAIT_SAID_AFTER_S = 10  # a wait for the other ranks this long is said: a node not started yet, or mistyped

class RankRun:
    """`with RankRun(cfg, place) as rank:` the rank's work, which calls rank.join_group() for its process group and
    rank.finished() at its end; then `rank.code` is the exit code, whatever ended the block (it is reported, so the
    block's exception goes no further)."""

    def __init__(self, cfg: Config, place):
        self.cfg, self.place = cfg, place  # place: main.RankPlace
        self.ctx: Optional[distributed.DistContext] = None
        self.watchdog: Optional[heartbeat.Watchdog] = None
        self.code: Optional[int] = None
        self.wait_said = False  # the line saying this rank waits for the others (waiting)
        self.time_used = 0.0  # of train.time_limit, before torchrun restarted this launch's workers
        self.restarted_after_a_stop = False  # torchrun restarted its workers after they had stopped and saved
        # Whether this rank's process (or its launcher) holds output_dir: one that does not writes nothing there
        # before the ranks meet, where rank 0's refusal (output_dir in use by another run) would end it.
        self.admitted = place.rank == 0 or (launcher_env() is None and cfg.dist.node_rank == 0)
        self.started = time.time()

    def __enter__(self) -> "RankRun":
        faults.progress.rank = self.place.rank
        threading.excepthook = resource_errors.thread_exception  # a writer thread's full disk: one line, from main
        faults.no_stdin()  # no prompt can wait on, or be answered from, the terminal
        # Libraries' download and loading bars are for terminals; in log files they are noise (read at import).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if self.cfg.mode in ("train", "lr_find"):  # (lr_find: the sweep stops at the vote, its files written)
            limit = config.parse_duration(self.cfg.train.time_limit)
            # (torchrun: the launch record; a rank not admitted yet writes it in join_group)
            used = elastic.time_used(self.cfg.output_dir, self.place.local_rank, record=self.admitted)
            self.restarted_after_a_stop = elastic.restarted_after_a_stop(self.cfg.output_dir)
            elastic.record_exit(self.cfg.output_dir, self.place.local_rank, None)  # (this launch's record only)
            self.time_used = used if limit else 0.0
            faults.stop_request.install(self.cfg.train.stop_signal, limit, self.time_used, kept=(
                "the sweep so far is written to lr_find.csv" if self.cfg.mode == "lr_find" else None))
        return self

    def join_group(self) -> distributed.DistContext:
        """This rank's log file, the process group, this rank's share of the CPU threads, and (several ranks) the
        heartbeat watchdog."""
        cfg, place = self.cfg, self.place
        held = logging.handlers.BufferingHandler(capacity=10_000)  # a rank not admitted: its lines until the ranks met
        log = report.log = faults.stop_request.log = (setup_logging(cfg.output_dir, place.rank) if self.admitted
                                                      else held_lines(place.rank, held))
        log.info(f"rank {place.rank} on {HOST}: pid {os.getpid()}, local rank {place.local_rank} of "
                 f"{place.local_procs}, {place.world} ranks in all, {cfg.mode}", extra={"file_only": True})
        if self.time_used:
            log.info(f"train.time_limit counts from this torchrun launch's first start, {self.time_used:.0f} s ago: "
                     "torchrun restarted its workers")
        if self.restarted_after_a_stop:  # (what the stop's last line said, to run the command again, torchrun did)
            log.info("note: torchrun restarted its workers after they stopped and saved (exit code 3): training goes "
                     "on from that checkpoint. A stop signal sent to the workers, not to torchrun, ends so (torchrun "
                     "counts their stop as a failure); to stop a torchrun run, signal torchrun itself (docs/slurm.md, "
                     "section 4)")
        self.ctx = process_group.init(cfg, place.rank, place.world, place.local_rank, place.rendezvous, self.waiting)
        if not self.admitted:
            log = report.log = faults.stop_request.log = setup_logging(cfg.output_dir, place.rank)
            for record in held.buffer:
                log.handle(record)
            if cfg.mode in ("train", "lr_find"):  # the launch's first start, which __enter__ records for the others
                elastic.time_used(cfg.output_dir, place.local_rank, now=self.started)
        self.ctx.cpu_threads = distributed.share_cores(self.ctx, place.local_procs)  # the plan prints what it chose
        self.watchdog = heartbeat.start_watchdog(cfg, self.ctx)
        return self.ctx

    @contextlib.contextmanager
    def publishing_saves_on_crash(self, trainer):
        """After a crash in a run of one process, the checkpoint written in the background (train.async_save) is
        published before the crash is reported: complete on disk, the next run would remove it as a stale save.
        (Several ranks: the others may be gone, and publishing waits for every one.)"""
        try:
            yield
        except Exception:
            if trainer.ctx.world_size == 1:
                try:
                    trainer.finish_save()
                except Exception as e:  # the crash is the one reported; this is said beside it
                    trainer.log.warning(f"the checkpoint written in the background was not published: {first_line(e)}")
            raise

    @contextlib.contextmanager
    def trackers_closed_by_the_watchdog(self, trainer):
        """A rank the watchdog ends (a hung run, a peer's user error) leaves with os._exit, past every `finally`: rank
        0's trackers are closed marked failed first, as after a crash (trackers.closed_failed_on_crash)."""
        if self.watchdog is not None:
            self.watchdog.before_exit = lambda: trainer.trackers is not None and trainer.trackers.close(failed=True)
        try:
            yield
        finally:
            if self.watchdog is not None:
                self.watchdog.before_exit = None

    def waiting(self, seconds: float, where: str) -> None:
        """Called every half second while this rank waits for the others to join: a stop signal ends the wait (and
        the run) at once, and a long wait is said once, on the console too."""
        reason = faults.stop_request.reason
        if reason is not None:
            raise Stopped(f"stopped by {reason} while rank {self.place.rank} on {HOST} waited {seconds:.0f} s for the "
                          f"other ranks at {where}: nothing was trained")
        if seconds >= WAIT_SAID_AFTER_S and not self.wait_said:
            self.wait_said = True
            report.log.info(f"rank {self.place.rank} on {HOST}: waiting for the other ranks at {where} (up to "
                            f"dist.timeout_s={self.cfg.dist.timeout_s} s; {self.place.world} ranks in all)")

    def finished(self) -> None:
        """The rank's work is done: wait for all ranks before any closes its connections (else gloo can abort at
        exit)."""
        faults.progress.phase_starts(faults.progress.step, "done")
        distributed.barrier(self.ctx)

    def __exit__(self, kind, e: Optional[BaseException], traceback) -> bool:
        self.code = EXIT_OK if e is None else self.reported(e)
        if self.watchdog is not None:
            self.watchdog.stop()
        faults.progress.finished(self.code)
        if self.cfg.mode in ("train", "lr_find"):
            elastic.record_exit(self.cfg.output_dir, self.place.local_rank, self.code)
        # Tear the group down after a clean end, or when there are no peers; after a failure, peers may be gone and
        # tearing down could wait on them (the launcher ends this process instead).
        if self.ctx is not None and (self.code in (EXIT_OK, EXIT_STOPPED, EXIT_DIVERGED) or self.ctx.world_size == 1):
            distributed.shutdown(self.ctx)
        return True  # reported: the exit code carries it

    def reported(self, e: BaseException) -> int:
        """Report what ended the rank, once; returns the exit code."""
        if isinstance(e, UserError):
            return faults.user_error(f"error: {e}", self.watchdog)
        if isinstance(e, (Stopped, Diverged)):  # every rank raised it at the same step
            return report(e.exit_code, str(e))
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C, or a stop signal in test mode or predict (faults.Interrupted)
            return faults.interrupted(e, self.cfg.mode)
        reason = faults.stop_request.reason
        if reason is not None and faults.progress.phase == "setup" and isinstance(e, torch.distributed.DistError):
            # The stop reached rank 0 as it waited for the group, and its store left with it: not a crash of this one
            return report(EXIT_STOPPED, f"stopped by {reason} while rank {self.place.rank} on {HOST} set up (rank 0, "
                                        f"stopping, closed the rendezvous store): nothing was trained")
        # A crash: never lost, never silent; a full disk or read-only folder is one line.
        line = resource_errors.failure_line(e, self.cfg.output_dir)
        if line:
            return faults.user_error(f"error: {line}", self.watchdog)
        lost = self.watchdog.lost_peers(e) if self.watchdog is not None else ""
        return self.lost_peers_reported(e, lost) if lost else faults.crash_report(e, None)  # (None: no peer lost)

    def lost_peers_reported(self, e: BaseException, lost: str) -> int:
        """A collective failed because peers died (`lost` names them): the consequence, one line; its traceback goes
        to this rank's log alone. Returns the exit code."""
        code = report(EXIT_CRASH, f"rank {self.place.rank} on {HOST} failed {faults.progress.where()}: {lost}"
                                  f"{first_line(e, limit=300)}")
        with contextlib.suppress(OSError):  # (a full disk: the line was said all the same)
            report.log.error("".join(traceback.format_exception(e)).rstrip(), extra={"file_only": True})
        return code


def held_lines(rank: int, held: logging.Handler) -> logging.Logger:
    """A logger for rank `rank` whose lines go to `held` alone (RankRun.join_group)."""
    log = logging.getLogger(f"trainer.rank{rank}.before_the_group")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    log.addHandler(held)
    return log
