"""Test-only: let fairscale's FullyShardedDataParallel run on CPU with gloo, so that our fairscale FSDP code
(wrapping, no_sync, clipping, gathered model.pt + per-rank optimizer shards, resume, test mode) runs in CI.

The product refuses `fsdp_impl: fairscale` on CPU (config.validate): fairscale 0.4.13 calls CUDA stream APIs
unconditionally in its backward hooks. On CPU every operation is synchronous, so stream waits, `record_stream`
and `torch.cuda.synchronize` have nothing to order and can be no-ops; that is all this shim does, plus two
things gloo needs:

- reduce-scatter without bucketing: fairscale's bucket passes a (world, n) input with an (n,) output, which
  NCCL accepts (it checks sizes) and gloo rejects (it checks dim 0); unbucketed, fairscale flattens the input;
- clip_grad_norm_ moves the local norm with `.cuda()`: on CPU it stays where it is.

What this cannot show is the CUDA-only part: streams overlapping, NCCL, fp16 on a GPU (tests/test_gpu.py).
train() starts the ranks with the shim installed in each; benchmarks/bench_sharded_memory.py uses install()."""
import contextlib
import dataclasses
import sys

import torch


class _NoStream:
    """Stands in for torch.cuda.Stream on CPU, where there is only one, synchronous, stream: every
    `_NoStream()` is the same object (fairscale asserts that the current stream is the one it switched to).
    A class, not a function, because libraries annotate with it (`torch.cuda.Stream | None`)."""
    _the_one = None

    def __new__(cls, *args, **kwargs):
        if cls._the_one is None:
            cls._the_one = super().__new__(cls)
        return cls._the_one

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _StaysOnCPU:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def cuda(self) -> torch.Tensor:
        return self.tensor


def install() -> None:
    import fairscale.internal.reduce_scatter_bucketer as bucketer
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp

    assert not torch.cuda.is_available(), "the shim is for CPU runs only"
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda t, s: None if t.device.type == "cpu" else record_stream(t, s)

    setup_streams = fsdp.FullyShardedDataParallel._setup_streams

    def setup_cpu_streams(self) -> None:
        setup_streams(self)  # creates no streams without CUDA, but shares the (empty) dict with the children
        if self._is_root:
            for name in ("fp32_to_fp16", "all_gather", "post_backward"):
                self._streams.setdefault(name, _NoStream())

    fsdp.FullyShardedDataParallel._setup_streams = setup_cpu_streams
    bucketer.ReduceScatterBucketer._get_shard_size = lambda self, element_size, num_shards: 0
    calc_grad_norm = fsdp.calc_grad_norm
    fsdp.calc_grad_norm = lambda *args, **kwargs: _StaysOnCPU(calc_grad_norm(*args, **kwargs))


def train(cfg, procs: int) -> int:
    """main.run() for a config with fsdp_impl: fairscale on CPU: `procs` local ranks, each with the shim.
    Returns the exit code as main.run does (2 after a one-line user error)."""
    import torch.multiprocessing as mp
    from conftest import spawn
    # validate() refuses fairscale FSDP on CPU (rightly: without this shim it cannot run), so it is set after.
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="fsdp", fsdp_impl="fairscale"))
    try:
        spawn(_worker, args=(cfg, procs), nprocs=procs)
    except mp.ProcessExitedException as e:
        return e.exit_code
    return 0


def _worker(local_rank: int, cfg, procs: int) -> None:
    import main
    import wiring
    from core import process_end
    install()
    code = wiring.worker(cfg, main.RankPlace(rank=local_rank, local_rank=local_rank, world=procs, local_procs=procs))
    if code:
        sys.exit(code)
    process_end.end_process(0)  # as main.py's ranks end (see there)
