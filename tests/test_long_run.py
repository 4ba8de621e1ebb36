"""A week-long run, compressed: what a run keeps for its whole length (or a window of it) must not drift or grow."""
import torch

from core.distributed import DistContext
from core.run_log import LossWindow

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def test_the_loss_window_stays_exact_after_ten_million_steps():
    # train.log_every as long as the run (one line at the end): the window holds 10^7 steps' sums, as a resume gives
    # them back. In float32 a step's 3.25 added to 3.2e7 rounded to a multiple of 2, and the loss drifted.
    window = LossWindow(CPU)
    steps, loss_sum, count = 10 ** 7, 0.1 * 32, 32
    window.load_state_dict({"loss": steps * loss_sum, "count": steps * count})
    for _ in range(1000):
        window.add(torch.tensor(3.25), torch.tensor(32.0), samples=32)
    expected = (steps * loss_sum + 1000 * 3.25) / ((steps + 1000) * count)
    assert abs(window.flush()["loss"] - expected) < 1e-12 * expected
