"""train.profile_steps: a torch.profiler trace of chosen optimizer steps."""
from __future__ import annotations

import logging
import os

from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

from core import distributed


def check_config(cfg, fail) -> None:
    """train.profile_steps, set (config.validate asks): N (steps 1..N) or [first, last], steps counted from 1."""
    steps = cfg.train.profile_steps
    if isinstance(steps, int) and steps < 1:
        fail("train.profile_steps", f"must be >= 1 (profile steps 1..N), got {steps}")
    if isinstance(steps, list):
        whole = all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
        if len(steps) != 2 or not whole or not 1 <= steps[0] <= steps[1]:
            fail("train.profile_steps", f"must be N or [first, last] with 1 <= first <= last, got {steps}")


class StepProfiler:
    """A torch.profiler trace of optimizer steps [first, last], by each rank into output_dir/profile/rank<R>.*.json
    (TensorBoard's profiler plugin, Perfetto, chrome://tracing); an evaluation or save in the range is in it too."""

    def __init__(self, steps, output_dir: str, ctx: distributed.DistContext, log: logging.Logger):
        self.first, self.last = (1, steps) if isinstance(steps, int) else steps
        self.dir, self.ctx, self.log, self.prof = os.path.join(output_dir, "profile"), ctx, log, None

    def before_step(self, step: int) -> None:
        if self.prof is not None:
            if step > self.last:
                self.stop()
            else:
                self.prof.step()  # marks the step boundaries (ProfilerStep#N) in the trace
        elif self.first <= step <= self.last:  # a resume inside the range starts where it is
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else [])
            # A schedule that always records: with one, the profiler marks each step as ProfilerStep#<step>.
            self.prof = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD, record_shapes=True,
                                profile_memory=True)
            self.prof.step_num = step
            self.prof.start()
            self.started = step
        if self.prof is not None:
            self.current = step

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.stop()
        tensorboard_trace_handler(self.dir, worker_name=f"rank{self.ctx.rank}")(self.prof)
        self.log.info(f"profile of steps {self.started}-{self.current} written to {self.dir}")
        self.prof = None
