"""Real clusters on one machine, for tests: two "nodes" in network namespaces joined by a veth pair, and a
one-node SLURM (slurmctld + slurmd + munged from Debian's packages). Each helper skips the test (pytest.skip)
when the machine does not allow it: not root, no `ip netns`, no SLURM binaries, daemons that do not start.

Traffic goes only to 127.0.0.1 and to the two addresses below, which exist only inside the namespaces made here.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT

NODE_ADDRS = ("10.77.0.1", "10.77.0.2")  # node 0, node 1; inside the namespaces only


def sh(*cmd, timeout=30, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def clean_env(**extra) -> dict:
    """The environment of a rank started by hand: no launcher variables inherited from whatever runs the tests."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC_",
                                "GLOO_SOCKET_IFNAME"))}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it (processes this test started)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2, procs=()):
    """Poll until predicate() is truthy (returns it); fail after `timeout` s, or early if a process in `procs`
    exited (its output then tells why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                pytest.fail(f"waiting for {what}: a process exited with {p.returncode}\n{(out or '')[-2000:]}\n"
                            f"{(err or '')[-3000:]}")
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


# ==============================================================================================================
# Two nodes in network namespaces
# ==============================================================================================================
class Node:
    def __init__(self, index: int, netns: str, ifname: str, addr: str):
        self.index, self.netns, self.ifname, self.addr = index, netns, ifname, addr
        self.hostname = f"tnode{index}"

    def command(self, argv: list) -> list:
        """argv run inside this node's network namespace, with its own host name (a UTS namespace)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "node", *argv]

    def env(self, **extra) -> dict:
        # The host name resolves to nothing here, and on many machines a host name resolves to 127.0.x.1: gloo
        # would then announce a loopback address to the other node. Name the interface, as on a real cluster
        # with several networks (docs/slurm.md).
        return clean_env(GLOO_SOCKET_IFNAME=self.ifname, **extra)

    def pids(self) -> list[int]:
        r = sh("ip", "netns", "pids", self.netns, check=False)
        return [int(p) for p in r.stdout.split()]

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cleanup_netns(names: list[str]) -> None:
    for ns in names:
        r = sh("ip", "netns", "pids", ns, check=False)
        for pid in r.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in names:
        sh("ip", "netns", "del", ns, check=False)


@pytest.fixture
def two_nodes():
    """Two network namespaces, node 0 at 10.77.0.1/24 and node 1 at 10.77.0.2/24, joined by a veth pair, each
    with its loopback up. Names carry the pid, so concurrent test sessions do not collide."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("`ip` (iproute2) or `unshare` (util-linux) is missing")
    tag = f"tr{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    ifs = [f"{tag}v0", f"{tag}v1"]  # interface names: at most 15 characters
    _cleanup_netns(names)  # left over by an earlier session with the same pid
    made = []
    try:
        for ns in names:
            r = sh("ip", "netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {r.stderr.strip()}")
            made.append(ns)
        r = sh("ip", "link", "add", ifs[0], "netns", names[0], "type", "veth", "peer", "name", ifs[1],
               "netns", names[1], check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot make a veth pair: {r.stderr.strip()}")
        for ns, ifname, addr in zip(names, ifs, NODE_ADDRS):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        nodes = [Node(i, ns, ifname, addr) for i, (ns, ifname, addr) in enumerate(zip(names, ifs, NODE_ADDRS))]
        probe = sh(*nodes[1].command([sys.executable, "-c", f"""
import socket, sys
try:
    socket.create_connection(("{NODE_ADDRS[0]}", 9), timeout=5)
except ConnectionRefusedError:
    sys.exit(0)  # reached node 0, which has nothing on port 9
except OSError as e:
    sys.exit(f"node 1 cannot reach node 0: {{e}}")
"""]), check=False)
        if probe.returncode != 0:
            pytest.skip(f"namespaces made but unusable: {probe.stderr.strip()[-300:]}")
        yield nodes
    finally:
        _cleanup_netns(made)


# ==============================================================================================================
# A one-node SLURM
# ==============================================================================================================
SLURM_DIR = "/tmp/trainer-slurm"  # state, spool, logs, slurm.conf; fixed, so that a later session finds them
SLURM_CONF = os.path.join(SLURM_DIR, "slurm.conf")
JOB_NAME = "trainer-test"


def _slurm_conf(host: str) -> str:
    d = SLURM_DIR
    return f"""# written by tests/cluster.py: a one-node SLURM for the trainer's tests
ClusterName=trainertest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A running one-node SLURM. `env()` is the environment for its client commands (srun, sbatch, ...)."""

    def __init__(self, host: str):
        self.host = host
        try:  # the ranks meet at the node's name, as on a cluster; where it resolves to nothing, at 127.0.0.1
            socket.getaddrinfo(host, None)
            self.master_addr = host
        except OSError:
            self.master_addr = "127.0.0.1"

    def env(self, **extra) -> dict:
        return clean_env(SLURM_CONF=SLURM_CONF, **extra)

    def run(self, *cmd, timeout=30, check=True, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        return sh(*cmd, timeout=timeout, check=check, **kw)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is forgotten."""
        r = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def node_state(self) -> str:
        """The node's state as sinfo prints it (idle, mixed, down, ...), "" when no controller answers."""
        if not os.path.exists(SLURM_CONF):
            return ""  # without a config, the clients look for one in DNS, slowly
        try:
            r = self.run("sinfo", "-h", "-N", "-n", self.host, "-o", "%T", check=False, timeout=15)
        except subprocess.TimeoutExpired:
            return ""
        return r.stdout.strip().lower() if r.returncode == 0 else ""


def _munge_works() -> bool:
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return False
    enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True,
                                                  timeout=10).returncode == 0


def _start_munge() -> list[int]:
    """Make a key if there is none, start munged as the munge user (or root). Returns the pids started."""
    key = "/etc/munge/munge.key"
    if not os.path.exists(key):
        os.makedirs("/etc/munge", exist_ok=True)
        if shutil.which("mungekey"):
            sh("mungekey", "--create", "--keyfile", key, check=False)
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
        os.chmod(key, 0o400)
    user = "munge"
    try:
        import pwd
        pwd.getpwnam(user)
    except KeyError:
        user = None
    for path in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(path, exist_ok=True)
        if user:
            shutil.chown(path, user, user)
    if user:
        shutil.chown(key, user, user)
        cmd = ["runuser", "-u", user, "--", "munged"]
    else:
        cmd = ["munged", "--force"]
    sh(*cmd, check=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _munge_works():
        time.sleep(0.2)
    with contextlib.suppress(OSError, ValueError):
        with open("/run/munge/munged.pid") as f:
            return [int(f.read().strip())]
    return []


def _read_pid(path: str):
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            return int(f.read().strip())
    return None


def start_slurm():
    """Bring up (or find running) the one-node SLURM. Returns (Slurm, pids this call started) or skips."""
    if os.geteuid() != 0:
        pytest.skip("starting SLURM daemons needs root")
    missing = [b for b in ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol", "sinfo", "scancel")
               if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        pytest.skip(f"SLURM is not installed (missing {', '.join(missing)}; "
                    "apt-get install slurmctld slurmd munge slurm-client)")
    host = socket.gethostname().split(".")[0]
    slurm, started = Slurm(host), []
    os.makedirs(SLURM_DIR, exist_ok=True)
    if not _munge_works():
        started += _start_munge()
        if not _munge_works():
            pytest.skip("munged does not start (munge -n | unmunge fails)")

    if slurm.node_state() in ("idle", "mixed", "allocated", "completing"):
        return slurm, started  # an earlier session's daemons, same config: reuse them
    conf = _slurm_conf(host)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(SLURM_DIR, sub), exist_ok=True)
    old = open(SLURM_CONF).read() if os.path.exists(SLURM_CONF) else None
    if old != conf:
        with open(SLURM_CONF, "w") as f:
            f.write(conf)
    env = slurm.env()
    try:
        ctld_up = "UP" in slurm.run("scontrol", "ping", check=False, timeout=15).stdout
    except subprocess.TimeoutExpired:
        ctld_up = False
    if not ctld_up:
        # -c: a cold start, forgetting the jobs of an earlier session; -i: ignore stale state files
        r = slurm.run("slurmctld", "-c", "-i", "-f", SLURM_CONF, check=False, env=env)
        if r.returncode != 0:
            pytest.skip(f"slurmctld does not start: {r.stderr.strip()[-300:]}")
        time.sleep(0.5)
        pid = _read_pid(os.path.join(SLURM_DIR, "slurmctld.pid"))
        started += [pid] if pid else []
    if _read_pid(os.path.join(SLURM_DIR, "slurmd.pid")) is None or not os.path.exists(
            f"/proc/{_read_pid(os.path.join(SLURM_DIR, 'slurmd.pid'))}"):
        r = slurm.run("slurmd", "-f", SLURM_CONF, check=False, env=env)
        if r.returncode != 0:
            pytest.skip(f"slurmd does not start: {r.stderr.strip()[-300:]}")
        time.sleep(0.5)
        pid = _read_pid(os.path.join(SLURM_DIR, "slurmd.pid"))
        started += [pid] if pid else []
    deadline = time.monotonic() + 30
    state = ""
    while time.monotonic() < deadline:
        state = slurm.node_state()
        if state.startswith(("idle", "mixed", "allocated")):
            return slurm, started
        if state.startswith(("down", "drain")):
            slurm.run("scontrol", "update", f"NodeName={host}", "State=RESUME", check=False)
        time.sleep(0.5)
    log = ""
    with contextlib.suppress(OSError):
        log = open(os.path.join(SLURM_DIR, "slurmd.log")).read()[-500:]
    stop_slurm(started)
    pytest.skip(f"SLURM started but node {host} is not usable (state {state!r}); slurmd.log: {log}")


def stop_slurm(pids: list[int]) -> None:
    """Stop the daemons this session started (and only those)."""
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def slurm():
    """The one-node SLURM for this session. Test sessions running at once take turns (a lock file): the node
    has 2 CPUs, and each test's jobs need both."""
    if os.geteuid() != 0:
        pytest.skip("starting SLURM daemons needs root")
    os.makedirs(SLURM_DIR, exist_ok=True)
    lock = open(os.path.join(SLURM_DIR, "lock"), "w")
    deadline = time.monotonic() + 600
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.skip("another test session held the SLURM test lock for 10 minutes")
            time.sleep(1)
    started = []
    try:
        cluster, started = start_slurm()
        cluster.run("scancel", f"--name={JOB_NAME}", check=False)  # left over by an interrupted session
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            if started:
                sh("scancel", f"--name={JOB_NAME}", check=False, env=clean_env(SLURM_CONF=SLURM_CONF))
        stop_slurm(started)
        lock.close()



# ==============================================================================================================
# The run every launcher test compares with: our own spawn, 2 ranks x 16 samples, 20 steps, no dropout
# ==============================================================================================================
STEPS, RANK_BATCH = 20, 16
TRAIN_SETS = ["dist.strategy=ddp", f"train.max_steps={STEPS}", f"train.batch_size={RANK_BATCH}", "model.dropout=0",
              "train.eval_every=0", "log.progress_bar=false", "log.tensorboard=false", "train.log_every=2"]
TRAIN_ARGS = ["--params", "parameters.yml"] + [a for kv in TRAIN_SETS for a in ("--set", kv)]


@pytest.fixture(scope="session")
def spawn_reference(tmp_path_factory):
    """Final parameters of TRAIN_ARGS run by main.py's own spawn with 2 processes (computed once a session).
    Resume is bit-exact and the launchers only change who starts the processes, so a launched, interrupted and
    resumed run must land here within 1e-6."""
    from conftest import free_port, load_model_state
    from wiring import checked_config
    import main
    if "params" in _REFERENCE:  # test modules that import this fixture each get their own: compute it once
        return _REFERENCE["params"]
    out = tmp_path_factory.mktemp("spawn-reference")
    cfg = checked_config(os.path.join(ROOT, "parameters.yml"),  # parameters.yml, as the launched runs read it
                         TRAIN_SETS + ["dist.procs_per_node=2", f"output_dir={out}", f"dist.master_port={free_port()}"])
    assert main.run(cfg) == 0
    _REFERENCE["params"] = load_model_state(out, STEPS)
    return _REFERENCE["params"]


_REFERENCE: dict = {}


def checkpoint_steps(output_dir) -> list[int]:
    d = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step-") and n[5:].isdigit()
                  and os.path.exists(os.path.join(d, n, "meta.json")))


def freeze(pids, on: bool) -> None:
    """SIGSTOP (on) or SIGCONT the given processes: a test can then act between two steps of a run however
    fast the machine is."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP if on else signal.SIGCONT)


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to `pid` (a stopped process keeps it pending)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    bit = 1 << (signum - 1)
    return any(int(fields.get(k, "0").strip(), 16) & bit for k in ("SigPnd", "ShdPnd"))
