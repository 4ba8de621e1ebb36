"""The roll call before the process group is made over tcp:// or a file:// (process_group.join_group): the store
counts arrivals only, so each rank first posts how it counts and places the ranks and claims its own; rank 0 then gives
one verdict, which every rank that came says in the same line: nodes that count differently, a rank claimed twice
(another node's dist.node_rank, an earlier run's rendezvous file), or the ranks missing at dist.timeout_s, by node.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlparse

import torch.distributed as dist

from core.config import procs_per_node_list
from core.errors import UserError, first_line
from core.launch_env import launcher_env
from core.process_end import alive


def roll_call(store, rank: int, world_size: int, cfg, given_up: threading.Event, rendezvous: str) -> None:
    """Each rank posts how it counts the ranks and claims its own; rank 0 then gives its verdict: "ok" once every
    other rank answered with its count, else the first mismatch or the ranks missing at dist.timeout_s, which every
    rank that came then says in the same line (the launcher prints it once)."""
    d = cfg.dist
    mine = roll_call_entry(cfg, world_size)
    layout = mine["layout"]
    if rank == 0:
        claim = json.loads(store.compare_set("trainer-roll/rank/0", "", json.dumps(mine)).decode())
        if (claim["pid"], claim["host"]) != (mine["pid"], mine["host"]):
            raise UserError(taken(0, mine, claim, rendezvous, d.nodes))
        node_comes(store, d.node_rank, layout)
        try:
            verdict = count_answers(store, world_size, d.timeout_s, given_up, layout)
        except dist.DistStoreError as e:
            verdict = str(not_met(d, rank, world_size, rendezvous, e))
        store.set("trainer-roll/verdict", verdict)
        if verdict != "ok":  # every rank that came reads it (or refuses) before this process, the store's host, ends
            wait_until(lambda: all_left(store), 10.0, given_up)
            raise UserError(verdict)
        return
    node_comes(store, d.node_rank, layout)
    store.add("trainer-roll/came", 1)
    try:
        answer(store, rank, world_size, mine, d.timeout_s, given_up, rendezvous, d.nodes)
    finally:
        store.add("trainer-roll/left", 1)


def roll_call_entry(cfg, world_size: int) -> dict:
    """What a rank posts at the roll call: where it runs and how it counts the ranks."""
    d = cfg.dist
    # under torchrun or srun the launcher placed the ranks; ours: each node places them from its own config
    layout = procs_per_node_list(cfg) if launcher_env() is None else None
    return {"node": d.node_rank, "host": socket.gethostname(), "pid": os.getpid(), "world": world_size,
            "layout": layout, "counted from": f"dist.nodes={d.nodes}, dist.procs_per_node={d.procs_per_node}"}


def refuse_the_others(cfg, world_size: int, words: str, wait_s: float = 60.0) -> None:
    """Rank 0 refused before the ranks meet (output_dir in use by another run) where nothing ends the others (srun,
    other nodes): it hosts the roll call just long enough to give them `words` as its verdict; else they would wait
    dist.timeout_s for it, silent. A rendezvous it cannot host (the port in use) is left as it is."""
    d = cfg.dist
    if d.strategy in ("none", "dp") or world_size < 2 or d.init_method.startswith("file://"):
        return
    try:
        store = dist.TCPStore(d.master_addr or "127.0.0.1", d.master_port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=d.timeout_s), multi_tenant=True)
        store.compare_set("trainer-roll/rank/0", "", json.dumps(roll_call_entry(cfg, world_size)))
        store.set("trainer-roll/verdict", words)
        wait_until(lambda: count(store, "trainer-roll/left") >= world_size - 1, wait_s, threading.Event())
    except RuntimeError:  # (torch's DistError is one)
        return


def node_comes(store, node: int, layout: Optional[list[int]]) -> None:
    """The first rank of a node to come adds the ranks its node starts to those rank 0 waits for before it ends with
    a verdict (the store it hosts with it): a rank of that node started a moment later still reads the verdict."""
    me = secrets.token_hex(8)  # this rank's alone
    if layout is not None and store.compare_set(f"trainer-roll/node/{node}", "", me).decode() == me:
        store.add("trainer-roll/expected", layout[node])


def all_left(store) -> bool:
    """Every rank that came has left, and (by the nodes' counts) every rank of the nodes that came has come."""
    came = count(store, "trainer-roll/came")
    return count(store, "trainer-roll/left") >= came and came + 1 >= count(store, "trainer-roll/expected")


def count(store, key: str) -> int:
    """A counter's value, read (store.add(key, 0) would append to a FileStore's file at every poll)."""
    return int(store.get(key)) if store.check([key]) else 0


def answer(store, rank: int, world_size: int, mine: dict, timeout_s: float, given_up: threading.Event,
           rendezvous: str, nodes: int) -> None:
    """A rank other than 0: refuse if rank 0 counts otherwise or another process holds this rank, else answer and
    wait for rank 0's verdict."""
    claim = store.compare_set(f"trainer-roll/rank/{rank}", "", json.dumps(mine)).decode()
    first = json.loads(when_set(store, "trainer-roll/rank/0", timeout_s, given_up, lambda: "rank 0 never came"))
    other = json.loads(claim)
    # rank 0's count, or that of the process that took this rank before
    theirs = next((c for c in (first, other) if (c["world"], c["layout"]) != (world_size, mine["layout"])), None)
    words = None
    if theirs is not None:
        words = (f"the nodes count the ranks differently: node {mine['node']} ({mine['host']}) counts {world_size} "
                 f"from {mine['counted from']}, node {theirs['node']} ({theirs['host']}) counts {theirs['world']} from "
                 f"{theirs['counted from']}; start every node with the same dist.nodes and dist.procs_per_node (null "
                 "is one rank per GPU: nodes with different GPUs need a list)")
    elif (other["pid"], other["host"]) != (mine["pid"], mine["host"]):
        words = taken(rank, mine, other, rendezvous, nodes)
    if words:  # the first refusal's words are every rank's (rank 0's verdict, and each node's launcher, says them)
        raise UserError(store.compare_set("trainer-roll/refused", "", words).decode())
    store.add("trainer-roll/answered", 1)
    # (rank 0 came first, so its own timeout, said as the verdict, comes first)
    verdict = when_set(store, "trainer-roll/verdict", timeout_s + 5, given_up,
                       lambda: f"{count(store, 'trainer-roll/answered') + 1} of {world_size} ranks arrived")
    if verdict != "ok":
        raise UserError(verdict)


def taken(rank: int, mine: dict, theirs: dict, rendezvous: str, nodes: int) -> str:
    """The words for a rank another process claimed first: a node started with another's dist.node_rank, or a
    rendezvous file an earlier run left (its ranks end without the teardown in which torch removes it)."""
    if theirs["host"] == mine["host"] and not alive(theirs["pid"]):
        return (f"{rendezvous} holds the roll call of an earlier run (rank {rank} was pid {theirs['pid']} on "
                f"{theirs['host']}, which has ended): delete that file on one node, then start every node again")
    earlier = ", or, if the rendezvous file is an earlier run's, delete it" if rendezvous.startswith("file://") else ""
    return (f"rank {rank} is claimed twice: by node {theirs['node']} ({theirs['host']}, pid {theirs['pid']}) and node "
            f"{mine['node']} ({mine['host']}, pid {mine['pid']}); start each node with its own dist.node_rank "
            f"(0 to {nodes - 1}){earlier}")


def count_answers(store, world_size: int, timeout_s: float, given_up: threading.Event, layout) -> str:
    """Rank 0's verdict: "ok" when every other rank answered with rank 0's count, or a refusal's words."""
    def settled():
        return store.check(["trainer-roll/refused"]) or count(store, "trainer-roll/answered") >= world_size - 1
    if not wait_until(settled, timeout_s, given_up):
        answered = count(store, "trainer-roll/answered") + 1
        absent = [r for r in range(1, world_size) if not store.check([f"trainer-roll/rank/{r}"])]
        raise dist.DistStoreError(f"{answered} of {world_size} ranks arrived{none_from(absent, layout)}")
    return store.get("trainer-roll/refused").decode() if store.check(["trainer-roll/refused"]) else "ok"


def none_from(absent: list[int], layout: Optional[list[int]]) -> str:
    """"; none from node 1 (ranks 2-3)": the ranks that never claimed theirs, by node where this launcher placed
    them (layout: ranks per node; None under srun), so that the line says which node to start."""
    if not absent:
        return ""
    if layout is None:
        return f"; none from {ranks_named(absent)}"
    groups, first = [], 0
    for node, n in enumerate(layout):
        gone = [r for r in absent if first <= r < first + n]
        if gone:
            groups.append(f"node {node} ({ranks_named(gone)})")
        first += n
    return "; none from " + ", ".join(groups[:8]) + (f" and {len(groups) - 8} more nodes" if len(groups) > 8 else "")


def ranks_named(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def not_met(d, rank: int, world_size: int, rendezvous: str, e: Exception) -> UserError:
    """The line for ranks that did not meet: a node not started, another address or port, rank 0's store gone
    mid-meeting, or (at once, not after the timeout) rank 0 that cannot host the rendezvous on a port in use (srun's
    ranks are not checked before)."""
    if "EADDRINUSE" in str(e) and rendezvous.startswith("tcp://"):
        return UserError(f"rank {rank}: dist.master_port {d.master_port} is already in use on {socket.gethostname()} "
                         f"(another run?); pick a free one, e.g. --set dist.master_port={d.master_port + 1}")
    if any(lost in str(e) for lost in ("Broken pipe", "Connection reset")) and rendezvous.startswith("tcp://"):
        return UserError(f"rank {rank}: the rendezvous store at {rendezvous} went away while the ranks met "
                         f"({first_line(e)}): its host (rank 0, node 0) ended or cannot be reached; see node 0's "
                         "output, then start every node again")
    same = {"tcp": "dist.master_addr and dist.master_port", "file": "dist.init_method, a file all of them see"}
    scheme = urlparse(rendezvous).scheme
    fix = (f"start all {d.nodes} nodes (dist.node_rank 0 to {d.nodes - 1}) with the same {same[scheme]}"
           if d.nodes > 1 and scheme in same else "start every rank")
    return UserError(f"rank {rank}: the {world_size} ranks did not all meet at {rendezvous} within dist.timeout_s="
                     f"{d.timeout_s} ({first_line(e)}); {fix}, or raise dist.timeout_s")


def when_set(store, key: str, timeout_s: float, given_up: threading.Event, missing: Callable[[], str]) -> str:
    """`key`'s value once a rank set it, polled rather than store.get's wait: given_up ends it, and a FileStore's
    timeout is a bare RuntimeError (a traceback), not the DistStoreError that init says as a line."""
    if not wait_until(lambda: store.check([key]), timeout_s, given_up):
        raise dist.DistStoreError(missing())
    return store.get(key).decode()


def wait_until(done: Callable[[], bool], timeout_s: float, given_up: threading.Event) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or given_up.is_set():
            return False
        time.sleep(0.02)
    return True
