"""How the model is spread over devices. Each strategy is an `apply_<name>(model, cfg, ctx, task, train_set)` that
returns a `Parallel` (base.py: the one object the Trainer talks to); wiring.STRATEGIES lists them.

  replicated.py  none, dp, ddp      every rank holds everything; DDP all-reduces gradients
  zero.py        oss                optimizer state (and gradients) sharded: ZeRO-1/2
  fsdp.py        fsdp               parameters too: ZeRO-3 (FSDP2, fairscale FSDP)
  pipeline.py    pipe               the layers cut into stages on different ranks, micro-batches flow through
  tp.py          dist.tp > 1        each block's matrices split over a tp group; composes with ddp, fsdp and pipe
  mesh.py        the device mesh (dp x tp, or pp x dp x tp) that tp and its partners share
  fp16.py        fp16 loss scaling when ranks hold different gradients; memory.py: the bytes a rank holds
  async_save.py  train.async_save for none, dp and ddp (a writer thread)
  activation_checkpointing.py  model.activation_checkpointing, applied before the strategy
"""
