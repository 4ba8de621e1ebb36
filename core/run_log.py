"""What a run shows while it trains: each rank's log file and rank 0's console, the progress bars, the training
line and its loss window, an evaluation's progress (the plan, the trackers and the closing summary: run_record.py;
train.profile_steps' traces: profiling.py). The Trainer calls these; nothing here changes what is trained.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import warnings
from typing import Callable, Optional

import torch
from tqdm import tqdm

from core import disk_errors, distributed
from core.errors import printable


def setup_logging(output_dir: str, rank: int) -> logging.Logger:
    """Every rank logs to output_dir/logs/rank{N}.log; rank 0 also to the console."""
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    log = logging.getLogger(f"trainer.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = PrintableFormatter("%(asctime)s rank" + str(rank) + " %(message)s", "%H:%M:%S")
    fh = LogFile(os.path.join(output_dir, "logs", f"rank{rank}.log"))
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if rank == 0:
        sh = ConsoleHandler(sys.stdout)
        sh.setFormatter(PrintableFormatter("%(message)s"))
        sh.addFilter(lambda record: not getattr(record, "file_only", False))
        log.addHandler(sh)
    else:
        quiet_libraries()
    return log


class PrintableFormatter(logging.Formatter):
    """Log lines printable(): a path naming such a file is a line, not logging's 'Logging error' traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def warning_note(log: logging.Logger) -> Callable[[str], None]:
    """A `note` callback that logs its line as errors.warn_on_stderr prints one where no log is at hand, `warning: `
    first: the same warning reads the same in test mode and predict (logged) as in export (stderr)."""
    return lambda text: log.warning(f"warning: {text}")


QUIET_LIBRARIES = ("transformers", "peft")


def quiet_libraries() -> None:
    """Ranks > 0: the libraries' reports and warnings (the same on every rank) are rank 0's to show; their
    errors still show."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers sets up its logger, if not yet
    if "transformers" in sys.modules:  # it has: set it there
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=rf"({'|'.join(QUIET_LIBRARIES)})(\.|$)")


class StopsOnWriteError:
    """For a log handler: a write that fails for a full disk or a read-only file (disk_errors.py) is raised once,
    naming the file, in the main thread (by its next line if another thread met it), and the run stops; logging's
    own way is a traceback for every later line while the run goes on."""
    failed: Optional[OSError] = None
    pending = False  # failed, and not raised yet

    def handle(self, record: logging.LogRecord):
        if self.failed is None:
            return super().handle(record)
        if self.pending and threading.current_thread() is threading.main_thread():
            self.pending = False
            raise self.failed
        return False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError) and error.filename is None:
            error = OSError(error.errno, error.strerror, disk_errors.handler_file(self))
        if not isinstance(error, OSError) or disk_errors.disk_problem(error, "") is None:
            return super().handleError(record)  # (a closed pipe, say: logging's own report)
        self.failed = error
        self.pending = threading.current_thread() is not threading.main_thread()
        if not self.pending:
            raise self.failed from None


class LogFile(StopsOnWriteError, logging.FileHandler):
    """A rank's log file, output_dir/logs/rank<R>.log."""


class ConsoleHandler(StopsOnWriteError, logging.StreamHandler):
    """Rank 0's console. Lines go through tqdm.write, which prints them above the progress bar, never glued to it."""

    def __init__(self, stream):
        super().__init__(stream)
        # tqdm's default lock is a multiprocessing semaphore, which a rank the watchdog kills leaks (with a warning);
        # only this process draws bars: a thread lock is enough.
        tqdm.set_lock(threading.RLock())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def progress_bar(wanted: bool, **kwargs):
    """A tqdm bar when `wanted` (rank 0 with log.progress_bar) and stderr is a terminal, else None. Log lines go
    above it (ConsoleHandler)."""
    if not (wanted and sys.stderr.isatty()):
        return None
    return tqdm(dynamic_ncols=True, **kwargs)


def train_line(log: logging.Logger, tracked, bar, step: int, total: int, stats: dict) -> None:
    """Every rank writes the training line to its own log; rank 0 also to the console, or to the bar when there
    is one. The trackers (rank 0's trackers.Trackers, else None) get each value."""
    if bar is not None:
        bar.n = step
        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}", sps=f"{stats['samples_per_s']:.0f}")
    log.info(f"step {step}/{total} " + " ".join(f"{k}={v:.4g}" for k, v in stats.items()),
             extra={"file_only": bar is not None})  # the bar shows it on the console
    if tracked:
        tracked.scalars(step, {f"train/{k}": v for k, v in stats.items()})


class LossWindow:
    """Loss and throughput since the last training line. Adds device tensors without waiting for them.
    `step`: the optimizer steps done when the window opens (flush(step) then also gives ms_per_step)."""

    def __init__(self, ctx: distributed.DistContext, step: int = 0):
        self.ctx, self.step = ctx, step
        self.reset()

    def reset(self):
        # float64: a window may span a whole run (log_every as long as it), where float32 sums lose the loss's digits
        self.loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self.count = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self.samples, self.tokens, self.start = 0, None, time.perf_counter()

    def open_at(self, step: int) -> None:
        """Training (re)starts at `step`: throughput counts from now; the loss keeps what a checkpoint gave back."""
        self.step, self.samples, self.tokens, self.start = step, 0, None, time.perf_counter()

    # A checkpoint keeps the loss of the steps since the last training line (this rank's): a stop between two lines
    # would otherwise make the resumed run's next line average fewer steps than the uninterrupted run's.
    def state_dict(self) -> dict:
        return {"loss": self.loss.item(), "count": self.count.item()}

    def load_state_dict(self, saved: dict) -> None:
        self.loss.fill_(saved["loss"])
        self.count.fill_(saved["count"])

    def add(self, loss_sum: torch.Tensor, count: float, samples: int, tokens: Optional[int] = None):
        """tokens: this rank's input tokens (Task.tokens); None for a task without tokens (no tokens_per_s)."""
        self.loss += loss_sum
        self.count += count  # already summed over ranks; loss_sum is this rank's own
        self.samples += samples
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens

    def flush(self, step: Optional[int] = None) -> dict:
        # One all-reduce for the sums, then one wait for the device (the .tolist() below), which reads the already
        # global count too. Every rank runs the same task, so all of them send tokens, or none.
        counted = [float(self.samples)] + ([float(self.tokens)] if self.tokens is not None else [])
        counted = torch.tensor(counted, dtype=torch.float64, device=self.ctx.device)  # exact past 2^24 samples
        sums = distributed.all_reduce_sum(self.ctx, torch.cat([self.loss.reshape(1), counted]))
        loss, samples, *tokens, count = torch.cat([sums, self.count.reshape(1)]).tolist()
        elapsed = max(time.perf_counter() - self.start, 1e-9)  # after the wait: the device's work is done
        out = {"loss": loss / count if count else math.nan,  # nan: every step of the window was skipped
               "samples_per_s": samples / elapsed}
        if step is not None:  # wall time per optimizer step, skipped steps included (they took the time too)
            out["ms_per_step"] = 1000 * elapsed / max(step - self.step, 1)
            self.step = step
        if tokens:
            out["tokens_per_s"] = tokens[0] / elapsed
        self.reset()
        return out


def batch_tokens(task, batches: list[dict], reports: bool) -> Optional[int]:
    """The input tokens of one step's micro-batches on this rank (Task.tokens), for LossWindow.add: 0 on a rank
    whose replica's batch another rank counts (`reports` false: tp, pipe), None for a task without tokens."""
    n = [task.tokens(b) for b in batches]
    return None if None in n else sum(n) if reports else 0


EVAL_LOG_EVERY_S = 30.0  # a long evaluation (or predict) writes a line this often, so that it is visibly alive


class EvalProgress:
    """An evaluation shows it is alive: a second bar under the training bar on rank 0 (when there is one), and,
    every EVAL_LOG_EVERY_S seconds, a line in each rank's log (on rank 0's console too when there is no bar).
    `trainer`: the Trainer, for its log, its step and its bars (predict, without one: started() alone)."""

    def __init__(self, trainer, split: str, total: int):
        self.started(trainer.log, f"evaluating {split} at step {trainer.state.step}", f"/{total} batches", total,
                     trainer.progress_bar(total=total, desc=split, leave=False) if total else None)

    def started(self, log: logging.Logger, what: str, unit: str, total: Optional[int], bar) -> None:
        self.log, self.what, self.unit, self.total, self.bar, self.done = log, what, unit, total, bar, 0
        self.start = self.last = time.perf_counter()

    def batch_done(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if self.done == self.total:
                self.bar.close()
        now = time.perf_counter()
        if now - self.last >= EVAL_LOG_EVERY_S and self.done != self.total:
            self.last = now
            self.log.info(f"{self.what}: {self.done}{self.unit}, {now - self.start:.0f} s",
                          extra={"file_only": self.bar is not None})


def final_values(state, best_metric: str) -> dict:
    """What the trackers get as the run's summary (`state`: the Trainer's TrainState)."""
    values = {"steps": state.step}
    if state.best_step is not None:
        values.update({"best_step": state.best_step, f"best_dev_{best_metric}": state.best_value})
    return values
