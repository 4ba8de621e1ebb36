"""What the composition root (main.py, through wiring.py) plugs into the Trainer. Each default here does nothing, so
trainer.py reads, and runs, as a plain loop; resilience/ and extras/ fill them in (wiring.RunHooks)."""
from __future__ import annotations

from typing import Optional


class Hooks:
    def resume(self, trainer) -> bool:
        """Before the first step: continue from a checkpoint (train.resume). True: that run was complete."""
        return False

    def before_first_step(self, trainer) -> None:
        """After resume: what the auto settings time (train.batch_size / precision auto), a profiler's start."""

    def run_starts(self, trainer):
        """Rank 0, after before_first_step: record the run's start (config.yml, the plan) and return the trackers
        its numbers go to (scalars, summary, close), or None."""
        return None

    def run_ends(self, trainer) -> None:
        """Rank 0, once the run is done: its closing lines."""

    def phase_starts(self, step: int, phase: str) -> None:
        """This rank starts `phase` ("train", "eval", "save", "done") of optimizer step `step`: what a watchdog
        reads to name a rank that hangs, and what a profiler counts (wiring.RunHooks: faults.progress, the profiler).
        Nothing here changes a step's numbers."""

    def stop_vote(self) -> float:
        """1.0 when this rank asks every rank to stop after this step (a signal, the time limit), else 0.0. What runs:
        wiring.RunHooks asks resilience/faults.py's StopRequest, whose signal handler sets it."""
        return 0.0

    def stop_reason(self) -> Optional[str]:
        """Why this rank voted to stop, for the last line of the run."""
        return None
