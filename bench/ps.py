"""make bench-ps: the parameter server between hosts: Ember vs TensorFlow's
ParameterServerStrategy vs PyTorch's RPC parameter server.

The hosts are simulated on this machine (tests/python/simcluster.py, as in
bench/cluster.py): each is a network namespace with its own ``eth0`` on one
bridge, so every byte between a worker and a parameter server crosses a real
TCP connection between two network stacks.  Every link is limited to
--link-gbit (default 10 Gbit/s, bench-cluster's default: a real NIC's rate;
a tbf at both ends of each link; 0: unlimited).  The ps processes run on
hosts of their own (ps0, ps1), the 2 workers on two others (w0, w1), and
TensorFlow's coordinator (its chief) on a fifth (chief).  Where network
namespaces cannot be made (not root), every process runs on loopback instead,
the links are not limited, and the RESULT line says ``hosts=loopback``.

Two configurations, 1 ps and 2 ps, and two workloads; a round is one pull and
one push by one worker, and the 2 workers run rounds at once, asynchronously
(no worker waits for the other; Ember with staleness None):

  dense   one float32 table of 10,000,000 parameters (10,000 rows x 1,000;
          one table on every side, its rows split in two halves over 2 ps):
          pull all of it, compute a gradient g = 0.5 w on the worker, push g;
          the server applies SGD, w -= 0.01 g
  sparse  a 1,000,000 x 64 float32 table: pull 4,096 random rows (uniform,
          drawn on the worker each round), g = 0.5 rows, push the 4,096
          gradient rows; the server applies SGD to those rows (a row drawn
          twice gets both gradients).  Rows are split over 2 ps by Ember's
          row hash, by contiguous halves on the peers (TensorFlow's
          partitioner; the same split by hand for PyTorch)

Then (bench/ps_train.py, --train-rounds, default --rounds) the training
comparison the parameter server is for: a wide-and-deep click model
(1,000,000 x 16 item and 100,000 x 8 user embeddings) trained by 2 workers
asynchronously on 1 ps against the same Keras program on Ember's collective
(every gradient allreduced, the embeddings' densified), records/s, on a
local Spark session.

Each side in its documented best configuration:

  ember   ember._ember.PsServer on each ps host, an ember._ember.PsClient in
          each worker (one connection per shard; a call sends every shard's
          request before it reads the replies), clear text (encrypt=False),
          asynchronous.  The sparse table is materialised in full before the
          rounds (worker 0 pulls every row once), as the peers' tables are
          allocated in full
  tf      TensorFlow (the main venv) tf.distribute.ParameterServerStrategy with a
          ClusterCoordinator, as its tutorial (Parameter server training with
          ParameterServerStrategy) runs it: tf.distribute.Server on the ps and
          worker hosts (gRPC), the coordinator on the chief scheduling one
          tf.function per round (coordinator.schedule, then join); variables
          created under strategy.scope() with
          FixedShardsPartitioner(num_ps) on 2 ps.  The function reads the
          variable (dense: each shard's read_value(); sparse: sparse_read of
          the ids, a gather on the ps), computes g on the worker and updates
          on the ps (dense: assign_sub(0.01 g); sparse:
          scatter_sub(IndexedSlices(0.01 g, ids))), as Keras's SGD applies a
          dense and a sparse gradient
  torch   PyTorch's RPC parameter server (the venv's torch),
          the pattern of its tutorial (Implementing a Parameter Server Using
          Distributed RPC Framework): a ParameterServer object on each ps
          rank holds the tensors; a worker calls rpc_sync(ps, get) and
          rpc_sync(ps, apply_grads, args=(grads,)) (rpc_async to both ps at
          once on 2 ps), apply_grads does w.sub_(g, alpha=0.01) (sparse:
          index_select and index_add_).  TensorPipe with its uv transport and
          mpt_uv/basic channels: the ones it uses between real hosts (its
          shm transport and cma channel would work between these simulated
          hosts, which share one kernel, and bypass the network);
          TP_SOCKET_IFNAME=eth0, one intra-op thread per process
          (torch.set_num_threads(1), as bench-cluster's gloo)

Interleaved rounds (bench/rounds.py): for each ps count, every side's cluster
is started once and stays up; then each round times every (side, workload)
once, the order rotated from round to round.  A timed run: each worker runs
--warmup rounds, then both run rounds for --seconds from one start time;
rounds/s is the sum over the workers of each one's rounds over its own time
(TensorFlow: the coordinator schedules rounds/s x --seconds functions after a
calibration, and rounds/s is their number over the time to join them).  GB/s
moves the table bytes only, pulled plus pushed: dense 2 x 40 MB per round,
sparse 2 x 4,096 x 64 x 4 bytes (ids not counted), rounds/s x bytes / 1e9.
The table also shows, per side, the bytes each round put on the workers'
links (eth0 in and out, read from /proc/net/dev of the worker hosts: every
protocol's framing and control traffic included; a check that each side
moved what it was asked to), and the CPU seconds per round of its servers,
workers and coordinator (/proc/<pid>/stat, every thread).  The link
ceiling: min(ps, workers) x link rate / bytes pulled per round.

    make bench-ps                                   # 1 and 2 ps, 5 rounds, 10 Gbit/s links
    EMBER_BENCH_QUICK=1 make bench-ps               # smoke run: tiny tables, 1 round
    python bench/ps.py --ps 2 --link-gbit 0 --rounds 3 --sides ember,tf

The last line is
RESULT ps dense_vs_best=<x> sparse_vs_best=<x> dense_vs_best_<n>ps=<x> sparse_vs_best_<n>ps=<x>
  <side>_<workload>_rps_<n>ps=<x> <side>_<workload>_gbps_<n>ps=<x>  (side ember, tf, torch)
  ember_<workload>_vs_link_<n>ps=<x> link_gbit=<g> rounds=<r> workers=2 ps_min=1 ps_max=2
  dense_params=<p> sparse_rows=<r> sparse_batch=<b> load=<1-minute load average at the start>
  widedeep_async_rps=<x> widedeep_sync_rps=<x> widedeep_async_vs_sync=<x>
  hosts=sim|loopback
  [not_measured=tf,torch] [<peer>_error=<n>ps]
where <workload>_vs_best_<n>ps is Ember's median rounds/s over the better
peer's median rounds/s with n ps, and <workload>_vs_best the lower of the
two ps counts.  A peer that is not installed is listed in not_measured (its
keys nan); one whose every run failed with n ps in <peer>_error.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import rounds  # bench/rounds.py (bench/ is this script's path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"ember-bench-ps-secret-0123456789"
PREFIX = "embps"
PS_HOSTS = ["ps0", "ps1"]
WORKER_HOSTS = ["w0", "w1"]
CHIEF_HOST = "chief"
HOSTS = PS_HOSTS + WORKER_HOSTS + [CHIEF_HOST]
TF_PYTHON = TORCH_PYTHON = sys.executable  # TensorFlow and torch are in the main venv
SIDES = ("ember", "tf", "torch")
WORKLOADS = ("dense", "sparse")
LR = 0.01          # SGD on the server: w -= LR * g
GRAD_SCALE = 0.5   # the worker's "gradient": g = GRAD_SCALE * w
DENSE_COLS = 1000
SPARSE_COLS = 64
TAG = "@@ "        # protocol lines on a process's stdout start with this
# Ports per (ps count, side): base + 100 * configuration, so that a
# configuration's servers never wait for the last one's ports.
PORT_BASE = 29800


def port(conf: int, offset: int) -> int:
    return PORT_BASE + 100 * conf + offset


# ---------------------------------------------------------------- shared by the processes

def net_bytes(pid: str = "self", iface: str = "eth0") -> int:
    """rx + tx bytes of iface in the network namespace of pid."""
    with open("/proc/%s/net/dev" % pid) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[0]) + int(v[8])
    return -1


def say(obj: Any) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands() -> Any:
    """The launcher's JSON commands, one per stdin line, until EOF or quit."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            return
        yield cmd


def timed_window(step: Callable[[], None], cmd: Dict[str, Any], iface: str) -> Dict[str, Any]:
    """Rounds of step() from cmd['start'] (time.time()) for cmd['seconds']:
    this worker's rounds, its time from the start to its last round's end,
    and its link's bytes meanwhile."""
    delay = cmd["start"] - time.time()
    if delay > 0:
        time.sleep(delay)
    end = time.perf_counter() + cmd["seconds"]
    wire0 = net_bytes(iface=iface)
    t0 = time.perf_counter()
    n = 0
    while True:
        step()
        n += 1
        t = time.perf_counter()
        if t >= end:
            break
    return {"rounds": n, "sec": t - t0, "wire": net_bytes(iface=iface) - wire0}


def worker_loop(steps: Dict[str, Callable[[], None]], iface: str) -> None:
    """A worker's commands: warm (rounds untimed) and run (timed_window)."""
    say({"ready": True})
    for cmd in commands():
        step = steps[cmd["workload"]]
        if cmd["op"] == "warm":
            for _ in range(cmd["rounds"]):
                step()
            say({"warm": True})
        elif cmd["op"] == "run":
            say(timed_window(step, cmd, iface))


# ---------------------------------------------------------------- Ember

def ember_server(a: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    from ember import _ember as E

    srv = E.PsServer(SECRET, a.index, a.nps, a.workers, host=a.bind, port=a.port)
    say({"ready": True})
    for _ in commands():
        pass
    say(srv.stats())
    srv.close()


def ember_worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(REPO, "python"))
    import numpy as np
    from ember import _ember as E

    hosts = a.ps_addrs.split(",")
    ports = [a.port + k for k in range(len(hosts))]
    c = E.PsClient(hosts, ports, SECRET, a.index, a.workers, timeout_s=600.0)
    dense_rows = a.dense_params // DENSE_COLS
    c.declare("dense", "dense", dense_rows, DENSE_COLS, "sgd", LR, init="uniform",
              init_scale=0.05, seed=1)
    c.declare("sparse", "sparse", a.sparse_rows, SPARSE_COLS, "sgd", LR, init="uniform",
              init_scale=0.05, seed=2)
    if a.index == 0:  # every row of the sparse table exists before the rounds
        chunk = 1 << 16
        buf: Any = np.empty((chunk, SPARSE_COLS), dtype=np.float32)
        for lo in range(0, a.sparse_rows, chunk):
            some: Any = np.arange(lo, min(lo + chunk, a.sparse_rows), dtype=np.int64)
            c.pull("sparse", some, SPARSE_COLS, out=buf[:len(some)])
    w = np.empty((dense_rows, DENSE_COLS), dtype=np.float32)
    g = np.empty_like(w)
    rows = np.empty((a.batch, SPARSE_COLS), dtype=np.float32)
    rg = np.empty_like(rows)
    rng = np.random.default_rng(100 + a.index)

    def dense() -> None:
        c.pull("dense", None, DENSE_COLS, out=w)
        np.multiply(w, GRAD_SCALE, out=g)
        c.push("dense", None, g)

    def sparse() -> None:
        ids = rng.integers(0, a.sparse_rows, a.batch, dtype=np.int64)
        c.pull("sparse", ids, SPARSE_COLS, out=rows)
        np.multiply(rows, GRAD_SCALE, out=rg)
        c.push("sparse", ids, rg)

    worker_loop({"dense": dense, "sparse": sparse}, a.iface)
    c.close()


# ---------------------------------------------------------------- PyTorch

class ParameterServer:
    """One ps rank's tensors (its shard of each table), as in PyTorch's
    parameter-server tutorial; the module functions below are what the
    workers call through RPC."""

    def __init__(self, dense_rows: int, sparse_rows: int) -> None:
        import torch
        self.dense = torch.empty(dense_rows, DENSE_COLS).uniform_(-0.05, 0.05)
        self.sparse = torch.empty(sparse_rows, SPARSE_COLS).uniform_(-0.05, 0.05)


_PS: Optional[ParameterServer] = None


def ps_get_dense() -> Any:
    assert _PS is not None
    return _PS.dense


def ps_apply_dense(grad: Any) -> None:
    assert _PS is not None
    _PS.dense.sub_(grad, alpha=LR)


def ps_get_rows(ids: Any) -> Any:
    assert _PS is not None
    return _PS.sparse.index_select(0, ids)


def ps_apply_rows(ids: Any, grad: Any) -> None:
    assert _PS is not None
    _PS.sparse.index_add_(0, ids, grad, alpha=-LR)


def split_rows(n: int, parts: int) -> List[int]:
    """Contiguous halves (thirds, ...) of n rows: the first row of each part, and n."""
    return [n * k // parts for k in range(parts + 1)]


def torch_proc(a: argparse.Namespace) -> None:
    global _PS
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    nps = a.nps
    dense_cut = split_rows(a.dense_params // DENSE_COLS, nps)
    sparse_cut = split_rows(a.sparse_rows, nps)
    if a.role == "ps":
        torch.manual_seed(a.index)
        _PS = ParameterServer(dense_cut[a.index + 1] - dense_cut[a.index],
                              sparse_cut[a.index + 1] - sparse_cut[a.index])
        name, rank = "ps%d" % a.index, a.index
    else:
        name, rank = "w%d" % a.index, nps + a.index
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method="tcp://%s:%d" % (a.master, a.port), num_worker_threads=16,
        rpc_timeout=600, _transports=["uv"], _channels=["mpt_uv", "basic"])
    rpc.init_rpc(name, rank=rank, world_size=nps + a.workers, rpc_backend_options=opts)
    if a.role == "ps":
        say({"ready": True})
        rpc.shutdown()  # waits for every worker's shutdown
        return

    ps = ["ps%d" % k for k in range(nps)]
    gen = torch.Generator().manual_seed(100 + a.index)
    bounds = torch.tensor(sparse_cut[1:-1], dtype=torch.int64)  # ps k holds [cut[k], cut[k+1])

    def dense() -> None:
        futs = [rpc.rpc_async(p, ps_get_dense) for p in ps]
        params = [f.wait() for f in futs]
        grads = [w * GRAD_SCALE for w in params]
        for f in [rpc.rpc_async(p, ps_apply_dense, args=(g,)) for p, g in zip(ps, grads)]:
            f.wait()

    def sparse() -> None:
        ids = torch.randint(0, a.sparse_rows, (a.batch,), generator=gen)
        if nps == 1:
            rows = rpc.rpc_sync(ps[0], ps_get_rows, args=(ids,))
            grad = rows * GRAD_SCALE
            rpc.rpc_sync(ps[0], ps_apply_rows, args=(ids, grad))
            return
        shard = torch.bucketize(ids, bounds, right=True)
        picks = [(shard == k).nonzero().squeeze(1) for k in range(nps)]
        local = [ids[p] - sparse_cut[k] for k, p in enumerate(picks)]
        futs = [rpc.rpc_async(ps[k], ps_get_rows, args=(local[k],)) for k in range(nps)]
        rows = torch.empty(a.batch, SPARSE_COLS)
        for k, f in enumerate(futs):  # the rows in the batch's order, as a model needs them
            rows[picks[k]] = f.wait()
        grad = rows * GRAD_SCALE
        futs = [rpc.rpc_async(ps[k], ps_apply_rows, args=(local[k], grad[picks[k]]))
                for k in range(nps)]
        for f in futs:
            f.wait()

    worker_loop({"dense": dense, "sparse": sparse}, a.iface)
    rpc.shutdown()


# ---------------------------------------------------------------- TensorFlow

def tf_cluster(a: argparse.Namespace) -> Dict[str, List[str]]:
    return json.loads(a.tf_cluster)


def tf_server(a: argparse.Namespace) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": tf_cluster(a),
                                          "task": {"type": a.role, "index": a.index}})
    os.environ["GRPC_FAIL_FAST"] = "use_caller"  # as the tutorial sets it
    import tensorflow as tf

    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(r.cluster_spec(), job_name=r.task_type, task_index=r.task_id,
                                  protocol=r.rpc_layer or "grpc", start=True)
    say({"ready": True})
    server.join()


def tf_chief(a: argparse.Namespace) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": tf_cluster(a),
                                          "task": {"type": "chief", "index": 0}})
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf

    nps = a.nps
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(nps)
                   if nps > 1 else None)
    strategy = tf.distribute.ParameterServerStrategy(r, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    init = tf.random_uniform_initializer(-0.05, 0.05)
    dense_shape = (a.dense_params // DENSE_COLS, DENSE_COLS)
    sparse_shape = (a.sparse_rows, SPARSE_COLS)
    with strategy.scope():
        dense = tf.Variable(lambda: init(dense_shape, tf.float32), shape=dense_shape,
                            dtype=tf.float32, name="dense")
        table = tf.Variable(lambda: init(sparse_shape, tf.float32), shape=sparse_shape,
                            dtype=tf.float32, name="sparse")
    shards = list(getattr(dense, "variables", [dense]))
    placed = sorted({v.device for v in shards} |
                    {v.device for v in getattr(table, "variables", [table])})
    batch, rows = a.batch, a.sparse_rows

    @tf.function
    def dense_step() -> None:
        for v in shards:  # each ps's shard: read there, g here, the update there
            w = v.read_value()
            g = w * GRAD_SCALE
            v.assign_sub(g * LR, read_value=False)

    @tf.function
    def sparse_step() -> None:
        ids = tf.random.uniform([batch], 0, rows, dtype=tf.int64)
        got = table.sparse_read(ids)  # a gather on the ps (each shard's, on 2 ps)
        g = got * GRAD_SCALE
        table.scatter_sub(tf.IndexedSlices(g * LR, ids))

    steps = {"dense": dense_step, "sparse": sparse_step}
    pids = [p for p in a.net_pids.split(",") if p]

    def run(step: Any, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            coordinator.schedule(step)
        coordinator.join()
        return time.perf_counter() - t0

    rate: Dict[str, float] = {}
    say({"ready": True, "devices": placed})
    for cmd in commands():
        step = steps[cmd["workload"]]
        if cmd["op"] == "warm":
            run(step, a.workers)  # traces and registers the function on the workers
            n = max(cmd["rounds"], 1) * a.workers
            rate[cmd["workload"]] = n / run(step, n)
            say({"warm": True})
        elif cmd["op"] == "run":
            n = max(2 * a.workers, int(rate[cmd["workload"]] * cmd["seconds"]))
            delay = cmd["start"] - time.time()
            if delay > 0:
                time.sleep(delay)
            wire0 = sum(net_bytes(p, a.iface) for p in pids)
            sec = run(step, n)
            wire = sum(net_bytes(p, a.iface) for p in pids) - wire0
            say({"rounds": n, "sec": sec, "wire": wire})
    os._exit(0)  # the coordinator's threads would keep the process up


# ---------------------------------------------------------------- the launcher's side

class Proc:
    """A process on a (simulated) host: its stdout's protocol lines in a
    queue, its stderr in a log file."""

    def __init__(self, popen: Callable[..., subprocess.Popen], host: str, argv: List[str],
                 log: str, env: Optional[Dict[str, str]] = None, quits: bool = True) -> None:
        self.name = "%s on %s" % (os.path.basename(log)[:-4], host)
        self.quits = quits  # ends by itself after {"op": "quit"} (else: killed)
        self.log = log
        self.err = open(log, "w")
        self.p = popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=self.err, text=True, env=env)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(TAG):
                self.lines.put(line[len(TAG):])
        self.lines.put(None)

    def send(self, cmd: Dict[str, Any]) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def reply(self, timeout: float) -> Dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("%s: no reply in %.0f s; %s" % (self.name, timeout, self.tail()))
        if line is None:
            self.p.wait(5)
            raise RuntimeError("%s exited (status %s); %s" % (self.name, self.p.returncode,
                                                              self.tail()))
        return json.loads(line)

    def tail(self) -> str:
        self.err.flush()
        try:
            with open(self.log, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
            return "stderr: " + " | ".join(lines[-6:])[-1500:]
        except OSError:
            return "no stderr"

    def cpu(self) -> float:
        """CPU seconds of the process so far (every thread)."""
        try:
            with open("/proc/%d/stat" % self.p.pid) as f:
                v = f.read().rsplit(")", 1)[1].split()
            return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.send({"op": "quit"})
                assert self.p.stdin is not None
                self.p.stdin.close()
            except (OSError, ValueError):
                pass

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, 9)
            except (ProcessLookupError, PermissionError):
                self.p.kill()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.err.close()


class Hosts:
    """Simulated hosts, or loopback when namespaces cannot be made."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.iface = "eth0" if sim else "lo"

    def addr(self, host: str) -> str:
        return self.sim.addr(host) if self.sim else "127.0.0.1"

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        if self.sim:
            return self.sim.popen(host, argv, **kw)
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(list(argv), **kw)


class Side:
    """One side's cluster for one ps count: started once, then timed runs."""

    def __init__(self, name: str, hosts: Hosts, conf: int, nps: int, args: argparse.Namespace,
                 tmp: str) -> None:
        self.name, self.hosts, self.conf, self.nps, self.args = name, hosts, conf, nps, args
        self.tmp = tmp
        self.servers: List[Proc] = []
        self.workers: List[Proc] = []
        self.driver: List[Proc] = []  # who runs the rounds: the workers, or TF's chief
        self.info: Dict[str, Any] = {}

    def _argv(self, python: str, mode: str, **kw: Any) -> List[str]:
        a = self.args
        argv = [python, os.path.abspath(__file__), "--mode", mode, "--nps", str(self.nps),
                "--workers", str(a.workers), "--dense-params", str(a.dense_params),
                "--sparse-rows", str(a.sparse_rows), "--batch", str(a.batch),
                "--iface", self.hosts.iface]
        for k, v in kw.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        return argv

    def _proc(self, host: str, argv: List[str], label: str,
              env: Optional[Dict[str, str]] = None, quits: bool = True) -> Proc:
        return Proc(self.hosts.popen, host, argv,
                    os.path.join(self.tmp, "%s-%dps-%s.log" % (self.name, self.nps, label)), env,
                    quits)

    def start(self) -> None:
        getattr(self, "_start_" + self.name)()

    def _wait_ready(self, procs: List[Proc], timeout: float) -> None:
        for p in procs:
            got = p.reply(timeout)
            if not got.get("ready"):
                raise RuntimeError("%s: %s" % (p.name, got))
            if "devices" in got:
                self.info["devices"] = got["devices"]

    def _start_ember(self) -> None:
        a, h = self.args, self.hosts
        base = port(self.conf, 0)
        for k in range(self.nps):
            self.servers.append(self._proc(
                PS_HOSTS[k], self._argv(sys.executable, "ember_server", index=k,
                                        bind=h.addr(PS_HOSTS[k]), port=base + k),
                "ps%d" % k))
        self._wait_ready(self.servers, a.timeout)
        addrs = ",".join(h.addr(PS_HOSTS[k]) for k in range(self.nps))
        for i in range(a.workers):
            self.workers.append(self._proc(
                WORKER_HOSTS[i], self._argv(sys.executable, "ember_worker", index=i,
                                            ps_addrs=addrs, port=base), "w%d" % i))
        self._wait_ready(self.workers, a.timeout)
        self.driver = self.workers

    def _start_torch(self) -> None:
        a, h = self.args, self.hosts
        env = dict(os.environ, OMP_NUM_THREADS="1", TP_SOCKET_IFNAME=h.iface)
        env.pop("PYTHONPATH", None)
        master = h.addr(PS_HOSTS[0])
        for k in range(self.nps):
            self.servers.append(self._proc(
                PS_HOSTS[k], self._argv(TORCH_PYTHON, "torch", role="ps", index=k, master=master,
                                        port=port(self.conf, 40)), "ps%d" % k, env))
        for i in range(a.workers):
            self.workers.append(self._proc(
                WORKER_HOSTS[i], self._argv(TORCH_PYTHON, "torch", role="worker", index=i,
                                            master=master, port=port(self.conf, 40)),
                "w%d" % i, env))
        self._wait_ready(self.servers + self.workers, a.timeout)
        self.driver = self.workers

    def _start_tf(self) -> None:
        a, h = self.args, self.hosts
        cluster = {
            "chief": ["%s:%d" % (h.addr(CHIEF_HOST), port(self.conf, 30))],
            "worker": ["%s:%d" % (h.addr(WORKER_HOSTS[i]), port(self.conf, 20 + i))
                       for i in range(a.workers)],
            "ps": ["%s:%d" % (h.addr(PS_HOSTS[k]), port(self.conf, 10 + k))
                   for k in range(self.nps)]}
        spec = json.dumps(cluster, separators=(",", ":"))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        for k in range(self.nps):
            self.servers.append(self._proc(
                PS_HOSTS[k], self._argv(TF_PYTHON, "tf_server", role="ps", index=k,
                                        tf_cluster=spec), "ps%d" % k, env, quits=False))
        for i in range(a.workers):
            self.workers.append(self._proc(
                WORKER_HOSTS[i], self._argv(TF_PYTHON, "tf_server", role="worker", index=i,
                                            tf_cluster=spec), "w%d" % i, env, quits=False))
        self._wait_ready(self.servers + self.workers, a.timeout)
        pids = ",".join(str(p.p.pid) for p in self.workers) if self.hosts.sim else ""
        chief = self._proc(CHIEF_HOST, self._argv(TF_PYTHON, "tf_chief", tf_cluster=spec,
                                                  net_pids=pids), "chief", env)
        self._wait_ready([chief], a.timeout)
        self.driver = [chief]

    def procs(self) -> List[Proc]:
        return self.servers + self.workers + [p for p in self.driver if p not in self.workers]

    def run(self, workload: str) -> Dict[str, float]:
        """One timed run: rounds/s summed over the workers, the workers'
        link bytes per round, CPU seconds per round by role."""
        a = self.args
        for p in self.driver:
            p.send({"op": "warm", "workload": workload, "rounds": a.warmup})
        for p in self.driver:
            p.reply(a.timeout)
        cpu0 = {p: p.cpu() for p in self.procs()}
        start = time.time() + 0.2
        for p in self.driver:
            p.send({"op": "run", "workload": workload, "start": start, "seconds": a.seconds})
        got = [p.reply(a.timeout + a.seconds) for p in self.driver]
        cpu = {p: p.cpu() - cpu0[p] for p in self.procs()}
        n = sum(g["rounds"] for g in got)
        rps = sum(g["rounds"] / g["sec"] for g in got)
        wire = sum(g["wire"] for g in got) / n if self.hosts.sim else float("nan")

        def per_round(ps: List[Proc]) -> float:
            return sum(cpu[p] for p in ps) / n

        sec = max(g["sec"] for g in got)
        return {"rps": rps, "wire": wire, "rounds": n, "sec": sec,
                "cpu_servers": per_round(self.servers), "cpu_workers": per_round(self.workers),
                "cpu_chief": per_round([p for p in self.driver if p not in self.workers]),
                "cores": sum(cpu.values()) / sec}

    def close(self) -> None:
        """Asks every process that can end by itself to (the workers first:
        PyTorch's ps ranks end with their rpc.shutdown()), waits up to 15 s,
        and kills whatever is left (TensorFlow's servers never end)."""
        procs = self.driver + [p for p in self.procs() if p not in self.driver]
        for p in procs:
            if p.quits:
                p.stop()
        deadline = time.monotonic() + 15
        for p in procs:
            if p.quits:
                try:
                    p.p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            p.kill()


# ---------------------------------------------------------------- report

def finite(xs: Sequence[float]) -> List[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def med(xs: Sequence[float]) -> Optional[float]:
    ok = finite(xs)
    return rounds.spread(ok).median if ok else None


def cell(xs: Sequence[float], spec: str, width: int) -> str:
    ok = finite(xs)
    return "%-*s" % (width, rounds.fmt_spread(ok, spec) if ok else "n/a")


def kv(x: Optional[float]) -> str:
    return "%.3f" % x if x is not None and math.isfinite(x) else "nan"


def payload(workload: str, a: argparse.Namespace) -> int:
    """Bytes of table data one round pulls (the push moves as many)."""
    if workload == "dense":
        return a.dense_params // DENSE_COLS * DENSE_COLS * 4
    return a.batch * SPARSE_COLS * 4


def parse_count(s: str) -> int:
    s = s.strip().lower()
    for suffix, k in (("k", 10 ** 3), ("m", 10 ** 6)):
        if s.endswith(suffix):
            return int(float(s[:-1]) * k)
    return int(s)


def main() -> int:
    quick = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ps", default="1,2", help="ps counts (1 and/or 2)")
    ap.add_argument("--rounds", type=int, default=1 if quick else 5)
    ap.add_argument("--seconds", type=float, default=0.5 if quick else 2.0,
                    help="each timed run's length")
    ap.add_argument("--warmup", type=int, default=2 if quick else 3,
                    help="untimed rounds per worker before each timed run")
    ap.add_argument("--dense-params", type=parse_count, default=parse_count(
        "100k" if quick else "10M"), help="multiple of %d" % DENSE_COLS)
    ap.add_argument("--sparse-rows", type=parse_count, default=parse_count(
        "10k" if quick else "1M"))
    ap.add_argument("--batch", type=int, default=256 if quick else 4096,
                    help="rows per sparse round")
    ap.add_argument("--link-gbit", dest="link_gbit", type=float, default=10.0,
                    help="every link's rate in Gbit/s (0: unlimited)")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--loopback", action="store_true",
                    help="run on loopback even where hosts can be simulated")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for any one reply")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' stderr logs")
    ap.add_argument("--train-rounds", type=int, default=None,
                    help="rounds of the wide-and-deep training comparison (bench/ps_train.py: "
                         "async on the parameter servers vs allreduce); default --rounds, 0: none")
    # process modes (internal)
    ap.add_argument("--mode", choices=["ember_server", "ember_worker", "torch", "tf_server",
                                       "tf_chief"])
    ap.add_argument("--role")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--nps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=len(WORKER_HOSTS))
    ap.add_argument("--bind")
    ap.add_argument("--port", type=int)
    ap.add_argument("--ps-addrs")
    ap.add_argument("--master")
    ap.add_argument("--tf-cluster")
    ap.add_argument("--net-pids", default="")
    ap.add_argument("--iface", default="eth0")
    a = ap.parse_args()

    if a.mode:
        {"ember_server": ember_server, "ember_worker": ember_worker, "torch": torch_proc,
         "tf_server": tf_server, "tf_chief": tf_chief}[a.mode](a)
        return 0

    ps_counts = [int(x) for x in a.ps.split(",")]
    sides = [s for s in a.sides.split(",") if s]
    workloads = [w for w in a.workloads.split(",") if w]
    if not set(ps_counts) <= {1, 2} or not set(sides) <= set(SIDES) or \
            not set(workloads) <= set(WORKLOADS) or "ember" not in sides:
        ap.error("--ps from 1,2; --sides from %s with ember; --workloads from %s"
                 % (",".join(SIDES), ",".join(WORKLOADS)))
    if a.dense_params % DENSE_COLS or a.dense_params < DENSE_COLS * max(ps_counts):
        ap.error("--dense-params must be a multiple of %d, at least one row per ps" % DENSE_COLS)
    if a.rounds < 1 or a.workers != len(WORKER_HOSTS):
        ap.error("--rounds >= 1; --workers is %d" % len(WORKER_HOSTS))

    not_measured: List[str] = [s for s in SIDES if s not in sides]  # left out by --sides
    if "tf" in sides and subprocess.run(
            [TF_PYTHON, "-c", "import tensorflow"], capture_output=True).returncode != 0:
        print("note: %s cannot import tensorflow: tf is n/a" % TF_PYTHON)
        sides.remove("tf")
        not_measured.append("tf")
    if "torch" in sides and subprocess.run(
            [TORCH_PYTHON, "-c", "import torch.distributed.rpc as r; assert r.is_available()"],
            capture_output=True).returncode != 0:
        print("note: %s cannot import torch.distributed.rpc: "
              "torch is n/a" % TORCH_PYTHON)
        sides.remove("torch")
        not_measured.append("torch")

    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    import simcluster

    why = None if not a.loopback else "--loopback"
    if why is None:
        why = simcluster.available()
    mode = "sim" if why is None else "loopback"
    if why is not None:
        print("note: no simulated hosts (%s): every process runs on loopback, links not "
              "limited" % why)
    link_bits = int(a.link_gbit * 1e9) if mode == "sim" else 0

    # res[nps][side][workload] -> list of run dicts over rounds
    res: Dict[int, Dict[str, Dict[str, List[Dict[str, float]]]]] = {
        n: {s: {w: [] for w in workloads} for s in SIDES} for n in ps_counts}
    devices: Dict[int, Any] = {}
    errors: Dict[str, List[int]] = {}
    tmp = tempfile.mkdtemp(prefix="ember-bench-ps-")
    load = os.getloadavg()[0]  # other work on the machine at the start
    t_start = time.monotonic()
    print("bench-ps: %s hosts, %d workers, ps %s; dense %s params (%d x %d), sparse %s x %d, "
          "%d rows per round; %s; %d rounds of %.1f s runs"
          % (mode, a.workers, a.ps, f"{a.dense_params:,}", a.dense_params // DENSE_COLS,
             DENSE_COLS, f"{a.sparse_rows:,}", SPARSE_COLS, a.batch,
             "links at %g Gbit/s" % a.link_gbit if link_bits else "links unlimited",
             a.rounds, a.seconds), flush=True)
    sim_cm = simcluster.SimCluster(HOSTS, prefix=PREFIX) if mode == "sim" else None
    try:
        if sim_cm is not None:
            sim_cm.start()
        hosts = Hosts(sim_cm)
        for conf, nps in enumerate(ps_counts):
            limit = (sim_cm.rate_limited(link_bits) if sim_cm is not None and link_bits
                     else contextlib.nullcontext())
            with limit:
                started: Dict[str, Side] = {}
                try:
                    for s in sides:
                        t0 = time.monotonic()
                        side = Side(s, hosts, conf, nps, a, tmp)
                        started[s] = side  # closed below even if it failed to start
                        try:
                            side.start()
                        except Exception as e:
                            if s == "ember":
                                raise
                            print("%d ps: %s failed to start: %s" % (nps, s, e), flush=True)
                            errors.setdefault(s, []).append(nps)
                            continue
                        print("%d ps: %s up in %.1f s" % (nps, s, time.monotonic() - t0),
                              flush=True)
                        if "devices" in side.info:
                            devices[nps] = side.info["devices"]
                    live = [s for s in sides if s not in errors or nps not in errors[s]]
                    jobs: Dict[str, Callable[[], Dict[str, float]]] = {}
                    def job(s: str, w: str) -> Dict[str, float]:
                        # the other sides' clusters idle meanwhile: their CPU use is checked
                        others = [p for o, side in started.items() if o != s
                                  for p in side.procs()]
                        c0 = sum(p.cpu() for p in others)
                        got = started[s].run(w)
                        got["others_cores"] = (sum(p.cpu() for p in others) - c0) / got["sec"]
                        return got

                    for w in workloads:
                        for s in live:
                            jobs["%s %s" % (s, w)] = functools.partial(job, s, w)

                    def report(r: int, name: str, got: Dict[str, float], secs: float,
                               nps: int = nps) -> None:
                        s, w = name.split()
                        res[nps][s][w].append(got)
                        print("%d ps, round %d: %-13s %10.2f rounds/s  %7.3f GB/s  (%.1f s)"
                              % (nps, r + 1, name, got["rps"],
                                 got["rps"] * 2 * payload(w, a) / 1e9, secs), flush=True)

                    def failed(r: int, name: str, e: Exception, secs: float,
                               nps: int = nps) -> None:
                        print("%d ps, round %d: %s failed: %s" % (nps, r + 1, name, e),
                              flush=True)
                        if name.startswith("ember"):
                            raise e

                    rounds.interleaved(a.rounds, jobs, report=report, failed=failed)
                finally:
                    for side in started.values():
                        side.close()
    finally:
        if sim_cm is not None:
            sim_cm.close()
        if a.keep_logs:
            print("logs in %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    for s in sides:  # a peer none of whose runs of a workload gave a figure
        for nps in ps_counts:
            if s != "ember" and any(not res[nps][s][w] for w in workloads) and \
                    nps not in errors.get(s, []):
                errors.setdefault(s, []).append(nps)

    # ------------------------------------------------------------ tables and RESULT
    print("\n%d rounds, %.0f s in all; median [min-max] over rounds; rounds/s summed over the "
          "%d workers; GB/s = 1e9 bytes/s of table data pulled + pushed"
          % (a.rounds, time.monotonic() - t_start, a.workers))
    idle = [r["others_cores"] for n in ps_counts for s in SIDES for w in workloads
            for r in res[n][s][w]]
    if idle:  # every side's cluster stays up: the others idle while one runs
        print("the other sides' idle processes used at most %.3f cores during any run"
              % max(idle))
    result: Dict[str, Optional[float]] = {}
    vs_best: Dict[str, List[float]] = {w: [] for w in workloads}
    link_Bps = link_bits / 8.0
    for nps in ps_counts:
        if nps in devices:
            print("\n%d ps: TensorFlow placed the variables on %s" % (nps, ", ".join(devices[nps])))
        for w in workloads:
            pb = payload(w, a)
            ceiling = min(nps, a.workers) * link_Bps / pb if link_Bps else None
            print("\n== %s, %d ps: %s bytes pulled and pushed per round%s" % (
                w, nps, f"{pb:,}",
                "; link ceiling %.1f rounds/s" % ceiling if ceiling else ""))
            print("%-6s %-30s %-22s %9s %11s %11s %11s %7s" % (
                "side", "rounds/s", "GB/s", "wire/data", "cpu ms/rnd", "servers", "workers",
                "cores"))
            meds = {}
            for s in SIDES:
                runs = res[nps][s][w]
                rps = [r["rps"] for r in runs]
                meds[s] = med(rps)
                gbps = [x * 2 * pb / 1e9 for x in rps]
                wire = med([r["wire"] for r in runs])
                cpu = med([(r["cpu_servers"] + r["cpu_workers"] + r["cpu_chief"]) * 1e3
                           for r in runs])
                srv = med([r["cpu_servers"] * 1e3 for r in runs])
                wrk = med([r["cpu_workers"] * 1e3 for r in runs])
                cores = med([r["cores"] for r in runs])
                if s in sides:
                    print("%-6s %s %s %9s %11s %11s %11s %7s" % (
                        s, cell(rps, ",.2f", 30), cell(gbps, ".3f", 22),
                        "%.3f" % (wire / (2 * pb)) if wire is not None else "n/a",
                        "%.2f" % cpu if cpu is not None else "n/a",
                        "%.2f" % srv if srv is not None else "n/a",
                        "%.2f" % wrk if wrk is not None else "n/a",
                        "%.2f" % cores if cores is not None else "n/a"))
                result["%s_%s_rps_%dps" % (s, w, nps)] = meds[s]
                result["%s_%s_gbps_%dps" % (s, w, nps)] = med(gbps)
            peers = [x for x in (meds["tf"], meds["torch"]) if x]
            em = meds["ember"]
            ratio = em / max(peers) if em is not None and peers else None
            result["%s_vs_best_%dps" % (w, nps)] = ratio
            if ratio is not None:
                vs_best[w].append(ratio)
            result["ember_%s_vs_link_%dps" % (w, nps)] = (em / ceiling if em is not None and
                                                          ceiling else None)
            if ratio is not None:
                best = max(("tf", "torch"), key=lambda s: meds[s] or 0.0)
                print("Ember / best peer (%s): %.2fx" % (best, ratio))
    # the wide-and-deep model trained async on 1 ps against allreduce (local Spark)
    train_rounds = a.rounds if a.train_rounds is None else a.train_rounds
    if train_rounds > 0:
        import ps_train

        print("\n== wide-and-deep training, 2 workers, local Spark: async (1 ps) vs allreduce")
        with tempfile.TemporaryDirectory(prefix="ember-bench-wd-") as wd_dir:
            got = ps_train.widedeep(train_rounds, quick, wd_dir)
        for side in ("async", "sync"):
            print("%-6s %s records/s" % (side, cell(got[side], ".0f", 24)))
        wd_async, wd_sync = med(got["async"]), med(got["sync"])
        result["widedeep_async_rps"] = wd_async
        result["widedeep_sync_rps"] = wd_sync
        result["widedeep_async_vs_sync"] = (wd_async / wd_sync if wd_async and wd_sync
                                            else None)
    head = ["%s_vs_best=%s" % (w, kv(min(vs_best[w]) if vs_best[w] else None))
            for w in workloads]
    head += ["%s_vs_best_%dps=%s" % (w, n, kv(result.pop("%s_vs_best_%dps" % (w, n))))
             for w in workloads for n in ps_counts]
    tail = ["%s=%s" % (k, kv(v)) for k, v in result.items()]
    tail += ["link_gbit=%g" % (a.link_gbit if link_bits else 0), "rounds=%d" % a.rounds,
             "workers=%d" % a.workers, "ps_min=%d" % min(ps_counts),
             "ps_max=%d" % max(ps_counts), "dense_params=%d" % a.dense_params,
             "sparse_rows=%d" % a.sparse_rows, "sparse_batch=%d" % a.batch, "load=%.2f" % load,
             "hosts=" + mode]
    if not_measured:
        tail.append("not_measured=" + ",".join(not_measured))
    for s, ns in errors.items():
        tail.append("%s_error=%s" % (s, ",".join("%dps" % n for n in ns)))
    print("RESULT ps " + " ".join(head + tail))
    missing = any(not res[n]["ember"][w] for n in ps_counts for w in workloads)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
