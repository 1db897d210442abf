"""Reservation benchmark: Ember's rendezvous server vs TensorFlowOnSpark's.

N simulated nodes (N = 64, 256, 1024) register with a reservation server over
loopback, wait for the full cluster spec, and are then stopped.  Both systems
run through the same harness:

* the server lives in its own process (started fresh for every trial);
* the N nodes are threads spread over a fixed pool of node processes
  (WORKERS = 8, i.e. N/8 threads each, GIL switch interval 50 ms: see
  SWITCH_INTERVAL_S).  The pool is started once, before any timing; for every
  trial each process creates its threads, every thread blocks on an event, the
  process reports "armed", and only when all are armed does the parent take t0
  and send "go";
* each node thread: connect, register (index, host, executor id, pid, ports),
  wait for the full cluster spec, record CLOCK_MONOTONIC (shared by all
  processes on Linux), do a cheap check of what it got;
* a trial's time is from "go" until the last node had the spec as a Python
  object, and for Ember also until the server's wait_ready() returned (printed
  separately as "server ready").  On a small machine the gap between the two
  is the nodes' own work: N nodes each decoding an N-row spec into Python;
* teardown (server stop, Ember nodes report "done", clients close, server
  close) is not timed; the Ember server's events are checked for anything but
  registered/ready during the trial and done at teardown.

Ember node:  RendezvousClient(host, port, secret) (connect + authenticate),
             register(...), wait_spec() -> (ClusterSpec: the node table held in C, rows
             decoded to dicts on access, pos).
TFoS node:   reservation.Client(addr) (connect), register(meta),
             await_reservations() -> list of metas, exactly as TFSparkNode does
             (it polls QUERY then sleeps 1 s, then QINFO).  TFSparkNode also
             does an extra QINFO before registering; that is left out (it only
             favours TFoS).  TFoS's INFO logging is turned down to WARNING in
             every process (also in TFoS's favour).

Every process raises RLIMIT_NOFILE to its hard limit.  A TFoS trial that fails
(its listener thread dies, a node errors, or the wall-clock limit passes) is
reported as failed with the reason, diagnosed from where its nodes got to and
the kernel's ListenOverflows counter; it is never given a number.  When TFoS
fails at the largest N for another reason, tfos_select_probe() registers N
nodes one at a time to show whether its select() loop (FD_SETSIZE 1024) would
have survived anyway.

Each system gets the same TRIALS (3) trials per N, interleaved
(bench/rounds.py): round k runs one Ember and one TFoS trial (which goes
first alternates), before round k+1.  A system that fails at an N is not
retried at that N (its figure is "failed" whatever later trials would give).
Seconds are reported as median [min-max] of the trials.  EMBER_BENCH_QUICK=1
(make bench-smoke) runs N = 8, 16 instead, with the same harness and trial
counts.

The last line is machine-readable:
RESULT reservation n=1024 ratio=<tfos/ember medians|inf> ember_s=<median>
  ember_min_s=<x> ember_max_s=<x> tfos_s=<median|nan> tfos_min_s=<x> tfos_max_s=<x>
  trials=3 ember_server_s=<server ready> ratio_64=<r> ratio_256=<r>
with tfos_error=<tag> when TFoS failed at n (its seconds are then nan and
ratio=inf), ratio_<N> the same ratio at each smaller N, and
tfos_select_probe=<died|ok>.
"""

from __future__ import annotations

import collections
import functools
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import resource
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import rounds  # bench/rounds.py (bench/ is this script's path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "python"))

# EMBER_BENCH_QUICK=1 (make bench-smoke): tiny N, same harness and trials
QUICK = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
SIZES = (8, 16) if QUICK else (64, 256, 1024)
WORKERS = 8
# CPython's default 5 ms GIL switch interval is pathological with ~100+ threads
# per process that all return from a blocking C call at once: every waiter wakes
# every 5 ms to demand the GIL, and on 2 cores ~70% of the CPU goes to futex
# wake-ups and context switches (perf) -- 4 x 256 threads did not finish in 20 s.
# The node processes (the same ones for both systems) use a longer interval.
SWITCH_INTERVAL_S = 0.05
TRIALS = 3          # per system and N, interleaved (E T, T E, E T, ...)
EMBER_LIMIT_S = 30.0
TFOS_LIMIT_S = 60.0
NUM_PS = 1          # roles: 1 ps, 1 chief, the rest workers (TFoS's order)
CHIEF = True
HOST = "127.0.0.1"
THREAD_STACK = 256 * 1024


# ================================================================ helpers

def raise_nofile() -> Tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def expected_role(i: int, n: int) -> Tuple[str, int]:
    """TFoS's role order over indexes 0..n-1 (also Ember's, see rendezvous.h)."""
    if i < NUM_PS:
        return "ps", i
    if CHIEF and i == NUM_PS:
        return "chief", 0
    return "worker", i - NUM_PS - (1 if CHIEF else 0)


def _quiet_tfos() -> None:
    import logging
    import tensorflowonspark.reservation  # noqa: F401  (sets up basicConfig at INFO)
    logging.getLogger("tensorflowonspark").setLevel(logging.WARNING)


def _open_fds() -> Tuple[int, int]:
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
        return len(fds), max(fds)
    except OSError:
        return -1, -1


def listen_overflows() -> Optional[int]:
    """TcpExt ListenOverflows: SYNs dropped because a listen queue was full
    (system-wide)."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            d = dict(zip(head.split()[1:], vals.split()[1:]))
            return int(d["ListenOverflows"]) if "ListenOverflows" in d else None
    return None


def _err_text(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    code = getattr(e, "name", None)
    if code and type(e).__name__.startswith("Ember"):
        s = f"{type(e).__name__}[{code}]: {e}"
    return s


# ================================================================ node threads

class _Node:
    __slots__ = ("index", "t_conn", "t_reg", "t_done", "error", "entries", "role",
                 "task_index", "full", "client")

    def __init__(self, index: int) -> None:
        self.index = index
        self.t_conn: Optional[float] = None
        self.t_reg: Optional[float] = None
        self.t_done: Optional[float] = None
        self.error: Optional[str] = None
        self.entries = -1
        self.role = ""
        self.task_index = -1
        self.full: Optional[str] = None    # None = not fully checked, "ok" or a problem
        self.client: Any = None


def _check_full(rows: List[Tuple[int, str, int]], n: int) -> str:
    if [r[0] for r in rows] != list(range(n)):
        return "indexes are not 0..n-1 in order"
    for i, role, ti in rows:
        if (role, ti) != expected_role(i, n):
            return f"node {i} has role {role}:{ti}, expected {expected_role(i, n)}"
    return "ok"


def _ember_node(rec: _Node, n: int, port: int, secret: bytes, limit: float,
                full: bool, go: threading.Event, done: "_Counter",
                teardown: threading.Event) -> None:
    from ember import _ember
    go.wait()
    try:
        c = rec.client = _ember.RendezvousClient(HOST, port, secret, limit)
        rec.t_conn = time.monotonic()
        i = rec.index
        c.register(i, HOST, f"executor-{i}", os.getpid(), [20000 + i, 40000 + i], limit)
        rec.t_reg = time.monotonic()
        nodes, pos = c.wait_spec(limit)
        rec.t_done = time.monotonic()
        rec.entries = len(nodes)
        me = nodes[pos]
        if (me["index"], me["executor_id"], me["ports"]) != (i, f"executor-{i}",
                                                             [20000 + i, 40000 + i]):
            rec.error = f"spec position {pos} is {me}, not node {i}"
        rec.role, rec.task_index = me["role"], me["task_index"]
        if full:
            rec.full = _check_full([(d["index"], d["role"], d["task_index"]) for d in nodes], n)
        del nodes
    except BaseException as e:  # noqa: BLE001  (reported, never raised in a worker)
        rec.error = _err_text(e)
    finally:
        done.inc()
    teardown.wait()
    if rec.client is not None:
        try:
            if rec.t_done is not None:   # a finished node says so: no LOST event
                rec.client.report("done", 0, "", 5.0)
            rec.client.close()
        except BaseException:  # noqa: BLE001
            pass


def _tfos_node(rec: _Node, n: int, port: int, secret: bytes, limit: float,
               full: bool, go: threading.Event, done: "_Counter",
               teardown: threading.Event) -> None:
    from tensorflowonspark import reservation
    go.wait()
    try:
        c = rec.client = reservation.Client((HOST, port))
        rec.t_conn = time.monotonic()
        i = rec.index
        job_name, task_index = expected_role(i, n)   # TFoS assigns roles in the driver's template
        c.register({"executor_id": i, "host": HOST, "job_name": job_name,
                    "task_index": task_index, "port": 20000 + i, "tb_pid": 0, "tb_port": 0,
                    "addr": (HOST, 40000 + i), "authkey": secret})
        rec.t_reg = time.monotonic()
        info = c.await_reservations()
        rec.t_done = time.monotonic()
        rec.entries = len(info)
        mine = [m for m in info if m["executor_id"] == i]
        if len(mine) != 1:
            rec.error = f"node {i} appears {len(mine)} times in the spec"
        else:
            rec.role, rec.task_index = mine[0]["job_name"], mine[0]["task_index"]
        if full:
            rows = sorted((m["executor_id"], m["job_name"], m["task_index"]) for m in info)
            rec.full = _check_full(rows, n)
        del info
    except BaseException as e:  # noqa: BLE001
        rec.error = _err_text(e)
    finally:
        done.inc()
    teardown.wait()
    if rec.client is not None:
        try:
            rec.client.close()
        except BaseException:  # noqa: BLE001
            pass


class _Counter:
    """Counts finished nodes; wakes the worker's main thread only once, when the
    last one finishes (waking it per node would add a GIL hand-off per node)."""

    def __init__(self, total: int) -> None:
        self.n = 0
        self.total = total
        self.lock = threading.Lock()
        self.all_done = threading.Event()

    def inc(self) -> None:
        with self.lock:
            self.n += 1
            if self.n >= self.total:
                self.all_done.set()


# ================================================================ worker process

def _worker_main(conn: Any, wid: int) -> None:
    raise_nofile()
    threading.stack_size(THREAD_STACK)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from ember import _ember  # noqa: F401  (import cost is not part of any trial)
    _quiet_tfos()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "exit":
            return
        if msg[0] == "arm":
            _worker_trial(conn, wid, msg[1])


def _worker_trial(conn: Any, wid: int, t: Dict[str, Any]) -> None:
    kind, n, port, secret, limit = t["kind"], t["n"], t["port"], t["secret"], t["limit"]
    # TFoS's client has no timeouts of its own; bound every blocking call so a
    # dead server turns into an error instead of a hang (ember has its own).
    socket.setdefaulttimeout(limit if kind == "tfos" else None)
    recs = [_Node(i) for i in t["indexes"]]
    go, teardown, done = threading.Event(), threading.Event(), _Counter(len(recs))
    target = _ember_node if kind == "ember" else _tfos_node
    threads = []
    for k, rec in enumerate(recs):
        full = t["check"] == "all" or k == 0
        th = threading.Thread(target=target, name=f"node-{rec.index}", daemon=True,
                              args=(rec, n, port, secret, limit, full, go, done, teardown))
        th.start()
        threads.append(th)
    conn.send(("armed", wid))
    if conn.recv()[0] != "go":
        return
    go.set()
    deadline = time.monotonic() + limit + 5.0
    aborted = False
    while True:
        if done.all_done.wait(0.05):
            break
        if time.monotonic() > deadline:
            break
        if conn.poll():
            if conn.recv()[0] == "abort":
                aborted = True
                break
    conn.send(("result", wid, aborted, [
        (r.index, r.t_conn, r.t_reg, r.t_done, r.error, r.entries, r.role, r.task_index, r.full)
        for r in recs]))
    while conn.recv()[0] != "teardown":
        pass                       # a late "abort" crossing our result
    teardown.set()
    end = time.monotonic() + 5.0
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    stuck = sum(th.is_alive() for th in threads)
    socket.setdefaulttimeout(None)
    conn.send(("closed", wid, stuck))


class NodePool:
    """WORKERS long-lived processes that host the node threads."""

    def __init__(self, workers: int = WORKERS) -> None:
        self.size = workers
        self.ctx = mp.get_context("spawn")
        self.procs: List[Any] = []
        self.conns: List[Any] = []

    def start(self) -> "NodePool":
        for w in range(self.size):
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=_worker_main, args=(child, w), daemon=True,
                                 name=f"bench-nodes-{w}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        return self

    def close(self, kill: bool = False) -> None:
        for c, p in zip(self.conns, self.procs):
            if not kill:
                try:
                    c.send(("exit",))
                except OSError:
                    pass
        for c, p in zip(self.conns, self.procs):
            p.join(0.0 if kill else 5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> "NodePool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ================================================================ server process

def _server_main(conn: Any, kind: str, n: int, limit: float) -> None:
    raise_nofile()
    try:
        if kind == "ember":
            _ember_server(conn, n, limit)
        else:
            _tfos_server(conn, n, limit)
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send(("error", f"server process: {_err_text(e)}\n{traceback.format_exc()}"))
        except OSError:
            pass


def _ember_server(conn: Any, n: int, limit: float) -> None:
    from ember import _ember
    secret = _ember.random_secret()
    srv = _ember.RendezvousServer(secret, n, num_ps=NUM_PS, chief=CHIEF, host=HOST)
    conn.send(("port", srv.port, secret))
    deadline = time.monotonic() + limit
    last_timeout = ""
    while True:
        try:
            srv.wait_ready(0.25)
            conn.send(("ready", time.monotonic()))
            break
        except _ember.EmberTimeout as e:
            last_timeout = str(e)
        if time.monotonic() > deadline:
            conn.send(("error", f"wait_ready: {last_timeout}"))
            break
        if conn.poll():
            break            # abort or teardown
    msg = conn.recv()              # teardown
    events: Dict[str, int] = collections.Counter()
    notes: List[str] = []

    def drain(phase: str, normal: Tuple[str, ...]) -> None:
        while True:
            ev = srv.next_event(0)
            if ev is None:
                return
            kind, node, code, text = ev
            events[kind] += 1
            if kind not in normal and len(notes) < 8:
                notes.append(f"{phase}: {kind} node={node} code={code} text={text!r}")

    drain("during the trial", ("registered", "ready"))
    srv.stop()
    conn.send(("stopped", 0.0))
    conn.recv()                    # clients reported done and closed
    time.sleep(0.1)
    drain("at teardown", ("done",))
    srv.close()
    conn.send(("closed", 0.0, dict(events), notes, msg[0]))


def _tfos_server(conn: Any, n: int, limit: float) -> None:
    os.environ["TFOS_SERVER_HOST"] = HOST
    _quiet_tfos()
    from tensorflowonspark import reservation
    errors: List[str] = []

    def hook(args: Any) -> None:
        nfd, maxfd = _open_fds()
        errors.append(f"{args.exc_type.__name__}: {args.exc_value} (in thread "
                      f"{args.thread.name if args.thread else '?'}; the server process had "
                      f"{nfd} open fds, highest fd {maxfd}; "
                      f"{len(srv.reservations.get())} of {n} nodes had registered)")

    threading.excepthook = hook
    srv = reservation.Server(n)
    _, port = srv.start()
    conn.send(("port", port, os.urandom(16)))
    t_reg = None
    sent_error = False
    msg: Tuple[Any, ...] = ("?",)
    while True:
        if t_reg is None and srv.reservations.done():
            t_reg = time.monotonic()
            conn.send(("registered", t_reg))
        if errors and not sent_error:
            conn.send(("error", errors[0]))
            sent_error = True
        if conn.poll(0.005):
            msg = conn.recv()
            break
    listener_alive = any(th.is_alive() and "_listen" in th.name
                         for th in threading.enumerate())
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    accepted = sockets - 2   # less the listening socket and our pipe to the parent
    srv.stop()
    conn.send(("stopped", 0.0))
    conn.recv()
    if listener_alive:
        try:   # wake the select() loop so it sees done (as TFoS's own shutdown does)
            socket.setdefaulttimeout(2.0)
            c = reservation.Client((HOST, port))
            c.request_stop()
            c.close()
        except Exception:  # noqa: BLE001
            pass
    conn.send(("closed", 0.0, {"registered": len(srv.reservations.get()),
                               "open_connections": accepted}, errors[1:4], msg[0]))


# ================================================================ one trial

class Trial:
    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n
        self.ok = False
        self.seconds: Optional[float] = None
        self.error: Optional[str] = None        # why it failed
        self.error_key: Optional[str] = None    # short tag, no spaces
        self.server_ready: Optional[float] = None        # ember: wait_ready returned
        self.server_registered: Optional[float] = None   # tfos: all reservations in
        self.completed = 0
        self.nodes: List[Tuple[Any, ...]] = []
        self.errors: Dict[str, int] = {}
        self.server_events: Dict[str, int] = {}
        self.server_notes: List[str] = []
        self.phase: Dict[str, float] = {}
        self.teardown_s: Optional[float] = None
        self.pool_dirty = False
        self.listen_drops: Optional[int] = None         # SYNs dropped, full listen queue
        self.stages: Dict[str, int] = {}                # where the nodes got to

    def summary(self) -> str:
        if self.ok:
            s = f"{self.seconds:.3f} s"
            bits = []
            if self.server_ready is not None:
                bits.append(f"server ready {self.server_ready:.3f}")
            if self.server_registered is not None:
                bits.append(f"server had all {self.n} {self.server_registered:.3f}")
            for k in ("connect", "register"):
                if k in self.phase:
                    bits.append(f"last {k} {self.phase[k]:.3f}")
            if bits:
                s += " (" + ", ".join(bits) + ")"
        else:
            s = f"FAILED after {self.seconds:.1f} s: {self.error}"
        s += f"; {self.completed}/{self.n} nodes got the spec"
        if self.error_key == "listen_backlog":
            return s        # the error already says where the nodes got to
        if not self.ok and self.stages:
            s += " (" + ", ".join(f"{v} {k}" for k, v in self.stages.items() if v) + ")"
        if self.listen_drops:
            s += f"; {self.listen_drops} SYNs dropped by a full listen queue"
        errs = {e: c for e, c in self.errors.items() if not e.startswith("still waiting")}
        if errs:
            s += "; node errors: " + "; ".join(f"{c}x {e}" for e, c in
                                               sorted(errs.items(), key=lambda x: -x[1])[:4])
        return s


def _classify(tr: "Trial", text: str) -> str:
    t = text.lower()
    if "filedescriptor out of range" in t or "select()" in t:
        return "select_fd_limit"
    if (tr.stages.get("never connected") or tr.stages.get("connected, not registered")) \
            and tr.listen_drops:
        return "listen_backlog"
    if "timed out" in t or "timeout" in t or "limit" in t:
        return "timeout"
    if "reset" in t:
        return "connection_reset"
    if "refused" in t:
        return "connection_refused"
    head = "".join(ch if ch.isalnum() else "_" for ch in text.split(":", 1)[0].strip())
    return head[:40] or "error"


def run_trial(pool: NodePool, kind: str, n: int, limit: Optional[float] = None,
              check: str = "sample") -> Trial:
    """One timed trial: a fresh server process, the pool's threads as nodes.

    check="all" makes every node verify the whole spec (indexes and roles);
    "sample" only the first node of each worker (the rest check their own row).
    """
    assert kind in ("ember", "tfos") and n % pool.size == 0
    if limit is None:
        limit = EMBER_LIMIT_S if kind == "ember" else TFOS_LIMIT_S
    tr = Trial(kind, n)
    sconn, child = pool.ctx.Pipe()
    sp = pool.ctx.Process(target=_server_main, args=(child, kind, n, limit), daemon=True,
                          name=f"bench-server-{kind}")
    sp.start()
    child.close()
    try:
        if not sconn.poll(60):
            raise RuntimeError("server process did not start")
        m = sconn.recv()
        if m[0] != "port":
            raise RuntimeError(f"server process failed: {m[1]}")
        port, secret = m[1], m[2]
        for w, c in enumerate(pool.conns):
            c.send(("arm", {"kind": kind, "n": n, "port": port, "secret": secret,
                            "limit": limit, "check": check,
                            "indexes": list(range(w, n, pool.size))}))
        for c in pool.conns:
            if not c.poll(60) or c.recv()[0] != "armed":
                raise RuntimeError("a worker did not arm")
        drops0 = listen_overflows()
        t0 = time.monotonic()
        for c in pool.conns:
            c.send(("go",))
        _collect(pool, sconn, tr, t0, limit, drops0)
        _teardown(pool, sconn, tr)
    finally:
        sp.join(5.0)
        if sp.is_alive():
            sp.kill()
            sp.join(5.0)
        sconn.close()
    return tr


def _collect(pool: NodePool, sconn: Any, tr: Trial, t0: float, limit: float,
             drops0: Optional[int]) -> None:
    pending = {c: w for w, c in enumerate(pool.conns)}
    results: List[Tuple[Any, ...]] = []
    t_ready: Optional[float] = None
    server_error: Optional[str] = None
    server_open = True
    aborted = False
    deadline = t0 + limit

    def abort(why: str) -> None:
        nonlocal aborted, server_error, deadline
        server_error = server_error or why
        if not aborted:
            aborted = True
            for pc in pending:
                pc.send(("abort",))
            deadline = time.monotonic() + 10.0   # workers answer within ~50 ms

    def want_server() -> bool:
        return (tr.kind == "ember" and t_ready is None and server_error is None
                and server_open)

    while pending or want_server():
        left = deadline - time.monotonic()
        if left <= 0:
            if aborted or not pending:
                if pending:
                    tr.pool_dirty = True
                    server_error = server_error or "a node process did not answer"
                break
            abort(f"no result within the {limit:.0f} s limit")
            continue
        waitset = list(pending) + ([sconn] if server_open else [])
        for c in mpc.wait(waitset, timeout=left):
            if c is sconn:
                try:
                    m = sconn.recv()
                except EOFError:
                    server_open = False
                    if pending:
                        abort("the server process died")
                    continue
                if m[0] == "ready":
                    t_ready = m[1]
                elif m[0] == "registered":
                    tr.server_registered = m[1] - t0
                elif m[0] == "error":
                    # the server cannot make progress any more: stop waiting
                    if pending:
                        abort(m[1])
                    server_error = server_error or m[1]
                continue
            m = c.recv()
            if m[0] == "result":
                results.extend(m[3])
                del pending[c]
    t_end_wait = time.monotonic()
    drops1 = listen_overflows()
    if drops0 is not None and drops1 is not None:
        tr.listen_drops = drops1 - drops0
    tr.nodes = sorted(results)
    done = [r for r in results if r[3] is not None and r[4] is None]
    tr.completed = len(done)
    errs: Dict[str, int] = collections.Counter()
    for r in results:
        if r[4] is not None:
            errs[r[4][:300]] += 1
        elif r[3] is None:
            errs["still waiting when the trial ended"] += 1  # see tr.stages
        elif r[5] != tr.n:
            errs[f"spec has {r[5]} entries, expected {tr.n}"] += 1
        elif r[8] not in (None, "ok"):
            errs[f"full check: {r[8]}"] += 1
        elif (r[6], r[7]) != expected_role(r[0], tr.n):
            errs[f"node {r[0]} got role {r[6]}:{r[7]}"] += 1
    tr.errors = dict(errs)
    tr.stages = {
        "never connected": sum(r[1] is None and r[4] is None for r in results),
        "connected, not registered": sum(r[1] is not None and r[2] is None and r[4] is None
                                         for r in results),
        "registered, waiting for the spec": sum(r[2] is not None and r[3] is None and
                                                r[4] is None for r in results),
        "failed with an error": sum(r[4] is not None for r in results),
        "not reported": tr.n - len(results),
    }
    for k, col in (("connect", 1), ("register", 2)):
        ts = [r[col] for r in results if r[col] is not None]
        if ts:
            tr.phase[k] = max(ts) - t0
    if t_ready is not None:
        tr.server_ready = t_ready - t0
    if tr.kind == "ember" and t_ready is None and not server_error:
        server_error = "the server never reported ready"
    tr.ok = not server_error and not errs and len(results) == tr.n and tr.completed == tr.n
    if tr.ok:
        ends = [r[3] for r in results] + ([t_ready] if t_ready is not None else [])
        tr.seconds = max(ends) - t0
    else:
        tr.seconds = t_end_wait - t0
        first_err = max(errs.items(), key=lambda x: x[1])[0] if errs else ""
        tr.error = server_error or first_err or "incomplete"
        tr.error_key = _classify(tr, tr.error)
        if tr.error_key == "listen_backlog" and "limit" in tr.error:
            st = tr.stages
            stuck = st["never connected"] + st["connected, not registered"]
            tr.error = (f"after {limit:.0f} s only {st['registered, waiting for the spec']} of "
                        f"{tr.n} nodes had registered: {stuck} never got into the server "
                        f"({st['never connected']} still connecting, "
                        f"{st['connected, not registered']} connected on their side but never "
                        f"accepted, their REG unanswered); the listen queue overflowed "
                        f"{tr.listen_drops} times (listen backlog 10; the kernel drops the "
                        f"SYN or final ACK and the client retries after 1, 3, 7, 15, 31 s); "
                        f"the registered nodes poll QUERY forever")
        tr.pool_dirty = True


def _teardown(pool: NodePool, sconn: Any, tr: Trial) -> None:
    t = time.monotonic()
    try:
        sconn.send(("teardown",))
        if sconn.poll(10):
            sconn.recv()                       # "stopped"
    except (OSError, EOFError):
        pass
    for c in pool.conns:
        c.send(("teardown",))
    stuck = 0
    for c in pool.conns:
        if c.poll(15):
            m = c.recv()
            stuck += m[2]
        else:
            stuck += 1
    if stuck:
        tr.pool_dirty = True
    try:
        sconn.send(("clients-closed",))
        if sconn.poll(15):
            m = sconn.recv()
            while m[0] != "closed" and sconn.poll(5):
                m = sconn.recv()
            if m[0] == "closed":
                tr.server_events, tr.server_notes = m[2], m[3]
    except (OSError, EOFError):
        pass
    tr.teardown_s = time.monotonic() - t


# ================================================================ TFoS select() probe

def tfos_select_probe(n: int, timeout_s: float = 30.0) -> str:
    """Connects and registers n TFoS nodes one at a time (so its listen backlog
    never overflows) against a TFoS server in its own process, and reports how
    far it got.  Shows whether its select() loop survives n connections."""
    _quiet_tfos()
    from tensorflowonspark import reservation
    ctx = mp.get_context("spawn")
    sconn, child = ctx.Pipe()
    sp = ctx.Process(target=_server_main, args=(child, "tfos", n, timeout_s), daemon=True)
    sp.start()
    child.close()
    clients = []
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    t0 = time.monotonic()
    failure = ""
    try:
        m = sconn.recv()
        port = m[1]
        for i in range(n):
            try:
                c = reservation.Client((HOST, port))
                clients.append(c)
                c.register({"executor_id": i, "host": HOST})
            except Exception as e:  # noqa: BLE001
                failure = f"node {i} failed: {_err_text(e)}"
                break
            if time.monotonic() - t0 > timeout_s:
                failure = f"gave up after {timeout_s:.0f} s at node {i}"
                break
        time.sleep(0.2)
        server_err = ""
        while sconn.poll(0.2):
            m = sconn.recv()
            if m[0] == "error":
                server_err = m[1]
        done = len(clients) - (1 if failure.startswith("node") else 0)
        if not failure:
            return f"all {n} registered one at a time in {time.monotonic() - t0:.2f} s"
        return (f"{done} of {n} registered one at a time, then {failure}"
                + (f"; the server's listener thread died: {server_err}" if server_err else ""))
    finally:
        socket.setdefaulttimeout(old)
        for c in clients:
            try:
                c.close()
            except OSError:
                pass
        sp.kill()
        sp.join(5.0)
        sconn.close()


# ================================================================ the benchmark

def _seconds(trials: List[Trial]) -> Optional[List[float]]:
    """The trials' seconds; None unless every trial completed."""
    if not trials or not all(t.ok for t in trials):
        return None
    return [t.seconds for t in trials]  # type: ignore[misc]  (set when ok)


def _stats(trials: List[Trial]) -> Optional[rounds.Spread]:
    """(median, min, max) of the trials' seconds; None unless every trial completed."""
    xs = _seconds(trials)
    return None if xs is None else rounds.spread(xs)


def _fmt(x: Optional[float]) -> str:
    return "failed" if x is None else f"{x:.3f}"


def _kv(x: Optional[float]) -> str:
    return "nan" if x is None else f"{x:.3f}"


def _cell(trials: List[Trial]) -> str:
    """median [min-max] of the trials' seconds; "failed" unless every trial completed."""
    xs = _seconds(trials)
    return "failed" if xs is None else rounds.fmt_spread(xs, ".3f")


def _run_all(t_start: float) -> Dict[Tuple[str, int], List[Trial]]:
    results: Dict[Tuple[str, int], List[Trial]] = collections.defaultdict(list)
    pool = NodePool().start()
    print(f"node processes started in {time.monotonic() - t_start:.1f} s (not timed)")

    def trial(kind: str, n: int) -> None:
        """One trial of ``kind`` at ``n``, kept in results."""
        nonlocal pool
        if any(not t.ok for t in results[(kind, n)]):
            return     # failed at this N: its figure is "failed", not retried
        tr = run_trial(pool, kind, n)
        results[(kind, n)].append(tr)
        print(f"  {kind:5s} n={n:<5d} trial {len(results[(kind, n)])}: {tr.summary()}")
        if tr.server_notes:
            print("        server events: " + ", ".join(
                f"{k}={v}" for k, v in sorted(tr.server_events.items())))
            for note in tr.server_notes[:4]:
                print(f"        {note[:300]}")
        if tr.pool_dirty:   # threads may still hang in a dead server: fresh pool
            pool.close(kill=True)
            pool = NodePool().start()

    try:
        for n in SIZES:
            # round k: each system once, the first one alternating (E T, T E, ...)
            rounds.interleaved(TRIALS, {kind: functools.partial(trial, kind, n)
                                        for kind in ("ember", "tfos")})
    finally:
        pool.close()
    return results


def main() -> int:
    soft, hard = raise_nofile()
    from ember import _ember  # noqa: F401  (fail early if the extension is missing)
    import tensorflowonspark
    print(f"reservation benchmark: Ember {_ember.__version__} vs TensorFlowOnSpark "
          f"{tensorflowonspark.__version__}; N in {SIZES}; {os.cpu_count()} CPUs; "
          f"RLIMIT_NOFILE {soft}/{hard}")
    print(f"each trial: a fresh server process; N node threads over {WORKERS} node processes "
          f"(started once); timed from 'go' until the last node holds the spec; "
          f"{TRIALS} interleaved trials per system and N (limits: ember {EMBER_LIMIT_S:.0f} s, "
          f"tfos {TFOS_LIMIT_S:.0f} s; a system that fails at an N is not retried there)")
    t_start = time.monotonic()
    results = _run_all(t_start)

    big = SIZES[-1]
    st = {(k, n): _stats(results[(k, n)]) for k in ("ember", "tfos") for n in SIZES}
    srv_ready = {n: (rounds.spread([x.server_ready for x in results[("ember", n)]
                                    if x.server_ready is not None]).median
                     if any(x.server_ready is not None for x in results[("ember", n)])
                     else None) for n in SIZES}
    probe = None
    tfos_big_bad = [x for x in results[("tfos", big)] if not x.ok]
    if tfos_big_bad and tfos_big_bad[0].error_key != "select_fd_limit":
        # The timed run failed before TFoS's select() limit could matter; show
        # separately whether it would have survived N connections at all.
        probe = tfos_select_probe(big)

    def ratio(n: int) -> Optional[float]:
        """TFoS's median over Ember's at n (inf: TFoS failed, Ember did not)."""
        e, t = st[("ember", n)], st[("tfos", n)]
        if e is None:
            return None
        return math.inf if t is None else t[0] / e[0]

    print()
    print(f"{'N':>6} | {'ember_s':>22} | {'tfos_s':>22} | {'ratio':>7} | "
          f"{'ember server ready':>18}")
    print("-" * 88)
    for n in SIZES:
        r = ratio(n)
        rs = "-" if r is None else ("inf" if math.isinf(r) else f"{r:.1f}x")
        print(f"{n:>6} | {_cell(results[('ember', n)]):>22} | {_cell(results[('tfos', n)]):>22} | "
              f"{rs:>7} | {_fmt(srv_ready[n]):>16} s")
    print(f"seconds, median [min-max] of {TRIALS} trials each; ratio = tfos median / ember "
          f"median; total run {time.monotonic() - t_start:.0f} s")
    for n in SIZES:
        for kind in ("ember", "tfos"):
            bad = [x for x in results[(kind, n)] if not x.ok]
            if bad:
                print(f"  {kind} n={n} failed [{bad[0].error_key}] in trial "
                      f"{len(results[(kind, n)])} of {TRIALS}: {bad[0].error[:400]}")
    if probe is not None:
        print(f"  tfos select() probe, n={big}: {probe}")
    print(f"  'ember server ready' = the server's wait_ready() returned (all registered, "
          f"spec queued); the rest of ember_s is the nodes receiving and decoding their "
          f"copy of the {big}-row spec into Python ({big} copies on {os.cpu_count()} CPUs)")

    e, t = st[("ember", big)], st[("tfos", big)]
    r = ratio(big)
    print()
    print(f"target: {big} nodes in under 1 s with Ember: "
          + ("met" if e is not None and e[0] < 1.0 else "NOT met")
          + f" (last node has the spec: {_fmt(e and e[0])} s; server ready: "
          f"{_fmt(srv_ready[big])} s)")
    print(f"target: at least 10x faster than TFoS at {big}: "
          + ("met" if r is not None and not math.isinf(r) and r >= 10 else
             ("TFoS did not complete, Ember did" if r is not None and math.isinf(r)
              else "NOT met")))
    parts = [f"RESULT reservation n={big}",
             "ratio=" + ("nan" if r is None else "inf" if math.isinf(r) else f"{r:.1f}")]
    for kind, x in (("ember", e), ("tfos", t)):
        parts += [f"{kind}_s={_kv(x and x[0])}", f"{kind}_min_s={_kv(x and x[1])}",
                  f"{kind}_max_s={_kv(x and x[2])}"]
    parts.append(f"trials={TRIALS}")
    parts.append(f"ember_server_s={_kv(srv_ready[big])}")
    for n in SIZES[:-1]:
        rn = ratio(n)
        parts.append(f"ratio_{n}=" + ("nan" if rn is None else "inf" if math.isinf(rn)
                                      else f"{rn:.1f}"))
    for kind in ("ember", "tfos"):
        bad = [x for x in results[(kind, big)] if not x.ok]
        if bad:
            parts.append(f"{kind}_error={bad[0].error_key}")
    if probe is not None:
        parts.append("tfos_select_probe=" + ("died" if "died" in probe else "ok"))
    print(" ".join(parts))
    ember_failed = any(not x.ok for n in SIZES for x in results[("ember", n)])
    return 1 if ember_failed else 0


if __name__ == "__main__":
    sys.exit(main())
