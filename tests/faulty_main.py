"""main.py with one fault injected into a rank, for tests/test_faults.py.

    FAULT=raise:RANK:STEP  rank RANK raises ValueError("injected fault") in step STEP
    FAULT=nan:RANK:STEP    rank RANK's loss is NaN in step STEP (so is every rank's gradient, after the all-reduce)
    FAULT=hang:RANK:STEP   rank RANK's main thread sleeps for an hour in step STEP (its watchdog thread still beats)
    FAULT=slow:RANK:STEP   every step sleeps STEP milliseconds on rank RANK (-1: all ranks): time to send signals
    FAULT=full:RANK:STEP   rank RANK's log file meets a full disk in step STEP (every write: OSError ENOSPC)
    FAULT=teardown:RANK:0  rank RANK, done, hangs for an hour closing its process group (as a stuck NCCL
                           communicator can)
    FAULT=abort:RANK:0     rank RANK, done, aborts (SIGABRT) closing its process group (as gloo's C++ can:
                           "terminate called without an active exception")
    FAULT=killprune:0:N    rank 0 is SIGKILLed halfway through deleting the Nth checkpoint it prunes (meta.json
                           and one file gone, the rest still there)
    FAULT=timing:-1:0      every rank logs `timing forward+backward` as train.batch_size auto starts timing it
    FAULT=slowinfer:-1:MS  every rank sleeps MS milliseconds before each batch a predict predicts and before each
                           split test mode evaluates: time to send signals to a run that does not train

The patch is made at import, outside the `__main__` guard: ranks started with the spawn method import this file
again (as __mp_main__), so they are patched too. The product has no test hook.
"""
import errno
import os
import shutil
import signal
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core import checkpoint, distributed  # noqa: E402
from extras import balance, predict  # noqa: E402
from resilience import faults  # noqa: E402
import trainer  # noqa: E402

FAULT = os.environ.get("FAULT", "")


class FullDisk:
    """A file on a full disk: every write fails as the kernel's would, with no file name."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    close = flush


if FAULT:
    kind, fault_rank, fault_step = FAULT.split(":")
    original_step = trainer.Trainer.train_step

    def train_step(self, batches):
        here = int(fault_rank) in (self.ctx.rank, -1)
        if kind == "slow" and here:
            time.sleep(int(fault_step) / 1000)
        elif here and self.state.step + 1 == int(fault_step):
            if kind == "raise":
                raise ValueError("injected fault")
            if kind == "hang":
                time.sleep(3600)
            if kind == "full":
                log_file = next(h for h in self.log.handlers if hasattr(h, "baseFilename"))
                log_file.stream = FullDisk()
            if kind == "nan":
                loss_sum = self.task.loss_sum
                self.task.loss_sum = lambda model, batch: loss_sum(model, batch) * float("nan")
                try:
                    return original_step(self, batches)
                finally:
                    self.task.loss_sum = loss_sum
        return original_step(self, batches)

    trainer.Trainer.train_step = train_step
    original_shutdown = distributed.shutdown

    def shutdown(ctx):
        if kind == "teardown" and ctx.rank == int(fault_rank):
            time.sleep(3600)
        if kind == "abort" and ctx.rank == int(fault_rank):
            os.abort()
        return original_shutdown(ctx)

    distributed.shutdown = shutdown

    if kind == "killprune":
        pruned = []

        def rmtree(path, ignore_errors=False):
            pruned.append(path)
            if len(pruned) == int(fault_step):
                os.remove(os.path.join(path, sorted(os.listdir(path))[0]))  # meta.json already went first
                os.kill(os.getpid(), signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=ignore_errors)

        checkpoint.shutil = types.SimpleNamespace(rmtree=rmtree)  # only core/checkpoint.py's deletes

    if kind == "timing":
        time_forward_backward = balance.time_forward_backward

        def timing(strategy, ctx, *args, **kwargs):
            faults.report.log.info("timing forward+backward")
            return time_forward_backward(strategy, ctx, *args, **kwargs)

        balance.time_forward_backward = timing

    if kind == "slowinfer":
        make_loader, evaluate = predict.make_loader, trainer.Trainer.evaluate

        def slow_loader(*args, **kwargs):
            for batch in make_loader(*args, **kwargs):
                time.sleep(int(fault_step) / 1000)
                yield batch

        def slow_evaluate(self, *args, **kwargs):
            time.sleep(int(fault_step) / 1000)
            return evaluate(self, *args, **kwargs)

        predict.make_loader, trainer.Trainer.evaluate = slow_loader, slow_evaluate

if __name__ == "__main__":
    import main
    faults.stop_request.catch_early()  # as main.py's own __main__
    faults.ignore_late_signals = True
    sys.exit(main.main())
