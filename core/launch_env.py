"""Who started this process: torchrun or SLURM's srun (their environment variables), or nobody (main.py starts the
ranks). Free of torch, so that the config can count the ranks before torch is loaded."""
from __future__ import annotations

import os
from typing import Optional

from core.errors import UserError


def launcher_env() -> Optional[dict]:
    """Rank information set by an external launcher: torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or SLURM's srun
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID). None when main.py should start the processes itself. Variables that
    no launcher would set so (left in the shell by another job) raise UserError naming them."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        # torchrun sets where rank 0 listens with the ranks; without it, env:// fails in torch with a traceback
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise left_over(["RANK", "WORLD_SIZE", "LOCAL_RANK"], f"RANK, WORLD_SIZE and LOCAL_RANK but not "
                                                                    f"{' and '.join(missing)}, as torchrun sets them")
        found = {"rank": number(env, "RANK"), "world_size": number(env, "WORLD_SIZE"),
                 "local_rank": number(env, "LOCAL_RANK"), "local_world_size": number(env, "LOCAL_WORLD_SIZE", "1"),
                 "launcher": "torchrun", "rendezvous": "env://"}
        names = ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and number(env, "SLURM_NTASKS") > 1 \
            and "SLURM_STEP_ID" in env:  # inside `srun`, one task per process (not a bare sbatch script)
        found = {"rank": number(env, "SLURM_PROCID"), "world_size": number(env, "SLURM_NTASKS"),
                 "local_rank": number(env, "SLURM_LOCALID", "0"), "local_world_size": tasks_on_this_node(env),
                 "launcher": "slurm", "rendezvous": None}
        names = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"]
    else:
        return None
    if not 0 <= found["rank"] < found["world_size"]:
        raise left_over(names, f"{names[0]}={found['rank']}, outside 0..{names[1]}-1 = 0..{found['world_size'] - 1}")
    return found


def first_on_node() -> bool:
    """Whether this process says a mistake found before the ranks meet: not started by torchrun or srun, or the
    first rank of its node (the others would repeat the same line, once per rank)."""
    try:
        env = launcher_env()
    except UserError:  # the mistake is in the launcher's variables: every process says it
        return True
    return env is None or env["local_rank"] == 0


def number(env, name: str, default: Optional[str] = None) -> int:
    """A launcher's variable as the whole number it always is."""
    value = env.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise left_over([name], f"{name}={value!r}, not a whole number") from None


def left_over(names: list, found: str) -> UserError:
    """The line for rank variables that no launcher set so: most often another job's, kept by the shell."""
    return UserError(f"the environment has {found}: left over from another job? `unset "
                     f"{' '.join(names)}` to let main.py start its ranks, or start it under torchrun or srun")


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
