"""The device mesh: the world's ranks as a grid with named dimensions ("dp_replicate", "dp_shard", "tp"), or
("pp", "dp", "tp") under pipe.

rank = (replica x shards + shard) x tp + tp_index, so the ranks of one tensor-parallel group are neighbours: with tp
no larger than a node's devices, the all-reduces of tensor parallelism (two per block in forward, four in backward)
stay inside a node, and only the data-parallel gradient reduction crosses nodes. The two data-parallel dimensions
together are "dp" (each index reads its own share of the global batch): fsdp shards over "dp_shard" and, with
dist.dp_replicate > 1, keeps that many replicas of the shards (HSDP: all-gathers stay inside a replica, and only
the gradient all-reduce crosses replicas); ddp sums over all of "dp". Under pipe, rank = (stage x pipelines +
pipeline) x tp + tp_index: a stage's replicas stay neighbours too, and only activations cross between stages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.distributed import DistContext


@dataclass
class Mesh:
    """The device mesh, and its two data-parallel dimensions flattened into one, "dp": mesh["tp"], mesh["dp"]."""
    root: DeviceMesh
    dp: DeviceMesh
    sequence_parallel: bool = False  # how tp splits the model (dist.*, strategies/tp.py): the plan says it
    loss_parallel: bool = False

    def __getitem__(self, names):
        return self.dp if names == "dp" else self.root[names]


def build_mesh(ctx: DistContext, tp: int, replicate: int = 1) -> Mesh:
    shards = ctx.world_size // (tp * replicate)
    root = init_device_mesh(ctx.device.type, (replicate, shards, tp), mesh_dim_names=("dp_replicate", "dp_shard",
                                                                                      "tp"))
    return Mesh(root, root["dp_replicate", "dp_shard"]._flatten("dp"))  # _flatten: as torchtitan does


def pipe_mesh(ctx: DistContext, pp: int, tp: int) -> Mesh:
    """pipe's mesh: pp stages x (world / (pp x tp)) pipelines x tp; "pp" pairs the ranks of one pipeline and one tp
    index, which send each other the activations."""
    root = init_device_mesh(ctx.device.type, (pp, ctx.world_size // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))
    return Mesh(root, root["dp"])


def fsdp_mesh(mesh: Mesh) -> DeviceMesh:
    """What FSDP2 shards over: "dp_shard", or (replicas, shards) for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


# What the start-up plan calls a coordinate along each dimension.
LABELS = {"dp_replicate": "replica", "dp_shard": "shard", "tp": "tp", "pp": "stage", "dp": "pipeline"}


def plan_lines(mesh: Mesh) -> list[str]:
    names, sizes = mesh.root.mesh_dim_names, mesh.root.shape
    labels = [LABELS[n] for n in names]
    formula = labels[0]  # row-major, the last dimension innermost: ((a x B + b) x C + c)
    for i in range(1, len(names)):
        formula = f"{f'({formula})' if i > 1 else formula} x {sizes[i]} + {labels[i]}"
    world = math.prod(sizes)
    coords = ", ".join(f"{k}=({','.join(str(c) for c in coordinates(k, sizes))})" for k in range(min(world, 8)))
    more = ", ..." if world > 8 else ""
    split = [what for on, what in [(mesh.sequence_parallel, "sequence parallel (norms on 1/tp of the positions)"),
                                   (mesh.loss_parallel, "loss parallel (head and logits split by vocabulary)")] if on]
    lines = [f"  mesh {' x '.join(f'{n} {s}' for n, s in zip(names, sizes))} (rank = {formula}); "
             f"ranks ({','.join(labels)}): {coords}{more}"]
    return lines + [f"  tp with {', '.join(split)}"] if split else lines


def coordinates(rank: int, sizes) -> list[int]:
    """A rank's index along each dimension of a row-major grid of these sizes."""
    out = []
    for size in reversed(sizes):
        rank, c = divmod(rank, size)
        out.append(c)
    return out[::-1]
