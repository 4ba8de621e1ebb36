"""Who started this process: torchrun or SLURM's srun (their environment variables), or nobody (main.py starts the
ranks). Free of torch, so that the config can count the ranks before torch is loaded."""
from __future__ import annotations

import os
from typing import Optional


def launcher_env() -> Optional[dict]:
    """Rank information set by an external launcher: torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or SLURM's srun
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID). None when main.py should start the processes itself."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env["LOCAL_RANK"]), "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1)),
                "launcher": "torchrun", "rendezvous": "env://"}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1 \
            and "SLURM_STEP_ID" in env:  # inside `srun`, one task per process (not a bare sbatch script)
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0)), "local_world_size": tasks_on_this_node(env),
                "launcher": "slurm", "rendezvous": None}
    return None


def tasks_on_this_node(env) -> int:
    """How many tasks of this srun step share this node (so that they share its cores). SLURM writes the tasks
    per node as `4(x2),1`: 4 on each of the first two nodes, 1 on the third; this node is SLURM_NODEID."""
    counts = []
    try:
        for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split(","):
            n, _, repeat = part.partition("(x")
            counts += [int(n)] * int(repeat.rstrip(")") or 1)
        return counts[int(env.get("SLURM_NODEID", 0))]
    except (ValueError, IndexError):  # a format this reader does not know: assume one task per node
        return 1
