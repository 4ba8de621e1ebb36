"""Activation memory of one training step under tensor parallelism, with and without sequence parallelism and
loss parallelism (dist.sequence_parallel, dist.loss_parallel).

    python benchmarks/bench_sp_memory.py [--model llama|bert] [--layers 4] [--width 256] [--heads 8] [--vocab 8192]
                                         [--batch 4] [--seq 256]

A random Llama (tasks/lm_models.tp_plan's plans) or BERT (tasks/text_common.bert_tp_plan's; sequence parallelism
only, its MLM head over every position) on 2 gloo CPU ranks, one forward of the LM loss: every tensor
autograd saves for backward is counted once (by storage) with torch.autograd.graph.saved_tensors_hooks, a DTensor
by its local piece. The figure is rank 0's bytes. Counted, not timed, so the machine's load does not matter.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = [("tp 1 (one process's model)", None), ("tp 2", (False, False)), ("tp 2 + sequence parallel", (True, False)),
           ("tp 2 + loss parallel", (False, True)), ("tp 2 + both", (True, True))]


def saved_bytes(model, ids, labels, lp: bool) -> int:
    """Bytes of the distinct tensors one forward of the loss saves for backward."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    seen = {}

    def pack(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        t = t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t  # its storage exists once waited
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (loss_parallel() if lp else
                                                                       contextlib.nullcontext()):
        logits = model(input_ids=ids).logits  # Llama's, or BertForMaskedLM's
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return sum(seen.values())


def worker(rank: int, args, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    make, plan = model_and_plan(args)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    for name, split in layouts(args):
        torch.manual_seed(0)
        model = make()
        if split is not None:
            parallelize_module(model, init_device_mesh("cpu", (2,)), plan(model, 2, *split))
        n = saved_bytes(model, ids, labels, split is not None and split[1])
        if rank == 0:
            queue.put((name, n))
    dist.barrier()
    dist.destroy_process_group()


def layouts(args) -> list:
    return LAYOUTS if args.model == "llama" else LAYOUTS[:3]  # BERT's plan has no loss parallelism


def model_and_plan(args):
    """A function making the random model, and its tp plan (model, tp, sequence_parallel[, loss_parallel])."""
    shape = dict(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=args.seq)
    if args.model == "bert":
        from transformers import BertConfig, BertForMaskedLM
        from tasks.text_common import bert_tp_plan
        config = BertConfig(**shape, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return (lambda: BertForMaskedLM(config)), (lambda model, tp, sp, lp: bert_tp_plan(model, tp, sp))
    from transformers import LlamaConfig, LlamaForCausalLM
    from tasks.lm_models import tp_plan
    config = LlamaConfig(**shape, num_key_value_heads=args.heads, tie_word_embeddings=False)
    return (lambda: LlamaForCausalLM(config)), tp_plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["llama", "bert"], default="llama")
    for key, default in [("layers", 4), ("width", 256), ("heads", 8), ("vocab", 8192), ("batch", 4), ("seq", 256)]:
        p.add_argument(f"--{key}", type=int, default=default)
    p.add_argument("--tiny", action="store_true",
                   help="seconds, to prove the script runs (tests/test_benchmarks.py); the figures mean nothing")
    args = p.parse_args()
    if args.tiny:  # seconds, not a measurement
        args.layers, args.width, args.heads, args.vocab, args.batch, args.seq = 1, 32, 2, 128, 1, 16
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, free_port(), queue), nprocs=2)
    print(f"{args.model} {args.layers} layers, width {args.width}, {args.heads} heads, vocabulary {args.vocab}; batch "
          f"{args.batch} x {args.seq} positions; saved for backward on rank 0:")
    results = [queue.get() for _ in layouts(args)]
    base = results[0][1]
    for name, n in results:
        print(f"  {name:28s} {n / 2**20:8.1f} MiB  ({n / base:.2f} of one process)")


if __name__ == "__main__":
    main()
