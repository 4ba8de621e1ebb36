"""SLURM's srun: how many tasks of this step share this node. Loaded only by the ranks srun started."""
from __future__ import annotations


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
