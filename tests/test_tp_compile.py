"""train.compile under tensor parallelism with dropout: the compiled blocks still draw each rank's own masks where
the data is split (strategies/tp.PerRankDropout), and the group's shared stream still ends equal on every rank. (Apart
from tests/test_tp.py: compiling takes a minute.)"""
import os

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, spawn


def _compiled_masks(rank, port, cache, queue):
    """One training forward of a tiny GPT-2 (attention dropout 0.5, 2 heads per rank) split over tp 2, its blocks
    compiled as DDPxTPStrategy.compile does, with and without PerRankDropout in the plan; rank 0 reports, per layer,
    whether the two ranks' attention probabilities were zeroed at the same places."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_CACHE_DIR=cache)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from strategies.activation_checkpointing import model_blocks
    from strategies.tp import PerRankDropout
    from tasks.lm_models import tp_plan
    from test_tp import _tiny
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for own in (True, False):
        torch.manual_seed(0)  # the group's shared stream (Strategy.seed_offset)
        model = _tiny("gpt2")
        plan = tp_plan(model, 2, False)
        assert any(isinstance(style, PerRankDropout) for style in plan.values())
        if not own:  # the control: the plan's other styles alone
            plan = {k: v.inner if isinstance(v, PerRankDropout) else v for k, v in plan.items()}
            plan = {k: v for k, v in plan.items() if v is not None}
        parallelize_module(model, tp, plan).train()
        for unit in model_blocks(model):
            unit.forward = torch.compile(unit.forward)
        probs = model(input_ids=torch.arange(16).view(2, 8) % 50, output_attentions=True).attentions
        ranks, streams = [None, None], [None, None]
        dist.all_gather_object(ranks, [p.detach() == 0 for p in probs])
        dist.all_gather_object(streams, torch.get_rng_state())
        if rank == 0:
            queue.put((own, [tuple(p.shape) for p in ranks[0]], [torch.equal(a, b) for a, b in zip(*ranks)],
                       torch.equal(*streams)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_blocks_draw_each_ranks_own_masks_where_the_data_is_split(tmp_path, capfd):
    queue = torch.multiprocessing.get_context("spawn").SimpleQueue()
    spawn(_compiled_masks, args=(free_port(), str(tmp_path / "inductor"), queue), nprocs=2)
    found = {}
    while not queue.empty():
        own, shapes, same, same_stream = queue.get()
        found[own] = (shapes, same, same_stream)
    assert found[True][0] == [(2, 2, 8, 8)] * 2  # 2 layers; batch 2, this rank's 2 heads, 8 x 8 positions
    assert found[True][1] == [False, False] and found[True][2]  # own masks per rank; the shared stream stays equal
    assert found[False][1] == [True, True] and found[False][2]  # without PerRankDropout both ranks draw the same masks
    assert any(os.scandir(tmp_path / "inductor"))  # the blocks were compiled
    assert "Graph break" not in capfd.readouterr().err  # the stream switch is left out of the compiled code quietly
