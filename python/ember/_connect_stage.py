"""The executor side of Ember over Spark Connect (:mod:`ember.connect`).

A Connect client may sit outside the cluster, so nothing here connects to
it: the nodes start in one barrier ``mapInArrow`` stage that lasts as long
as the cluster.  Its task 0 hosts the rendezvous server (the one a classic
driver hosts) and watches the nodes; the tasks learn its address, and then
the registered nodes, through ``BarrierTaskContext.allGather``; every task
runs its node as a child process and waits for it.  The stage ends when the
trainers are done (the others are then stopped) or at the first node
failure (the others are stopped at once); task 0's rows are the nodes'
final states, so failures reach the client as the stage's result.

Feeding tasks (``train(df)``, ``inference(df)``) run in later jobs on the
same executors: each task of the node stage writes the registered nodes to a
file on its host (:func:`registry_path`), where they find them.  The job
secret travels in the closures, never in that file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

from ember import _ember, _gpu, executor
from ember.errors import EmberError
from ember.executor import FeedCall, node_name
from ember.node import CHECKPOINT_REPORT, RESUME_REPORT, SERVING_REPORT

logger = logging.getLogger("ember.connect")

#: the node stage's rows (task 0's): one per node, its final state
STATE_SCHEMA = ("index int, role string, task_index int, host string, executor string, "
                "state string, error string")
#: the roles that read the feed, and that the stage waits for
TRAINER_ROLES = ("chief", "worker")


def registry_path(job_id: str) -> str:
    """Where a node stage's task writes the cluster's nodes on its host."""
    return os.path.join(tempfile.gettempdir(), f"ember-connect-{job_id}.json")


def node_stage(boot: Dict[str, Any], num_nodes: int, roles: Dict[str, Any],
               reservation_timeout: float, heartbeat_timeout: float,
               feed_roles: Tuple[str, ...]) -> Callable[[Any], Iterator[Any]]:
    """The barrier stage's task: node ``partition id``, with task 0 hosting
    the rendezvous and watching every node."""
    def task(_batches: Any) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        tc = BarrierTaskContext.get()
        part = tc.partitionId()
        infos = tc.getTaskInfos()
        address = infos[part].address if part < len(infos) else ""
        host = executor.host_of(address) or socket.gethostname()
        server = None
        if part == 0:
            # bound where the executor is reachable (its Spark address), not loopback
            server = _ember.RendezvousServer(
                boot["secret"], num_nodes, heartbeat_timeout_ms=int(heartbeat_timeout * 1000),
                host=host, **roles)
        try:
            told = tc.allGather(json.dumps([host, server.port]) if server else "")
            rv_host, rv_port = json.loads(told[0])
            gpu = tc.resources().get(_gpu.GPU)
            gpus = [str(a) for a in gpu.addresses] if gpu is not None else []
            node_boot = dict(boot, index=part, sys_path=list(sys.path), gpus=gpus,
                             executor_id=address or str(part), advertise_host=host,
                             driver_host=rv_host, driver_port=rv_port)
            pid = executor.spawn_node(node_boot, reservation_timeout)
            nodes: List[Dict[str, Any]] = []
            if server is not None:
                server.wait_ready(reservation_timeout)
                nodes = sorted(server.nodes(), key=lambda n: n["index"])
            nodes = json.loads(tc.allGather(json.dumps(nodes) if server else "")[0])
            _write_registry(boot["job_id"], nodes, boot["encrypt"], feed_roles)
            if server is None:
                _wait_exit(pid)
                return
            logger.info("cluster ready: " + ", ".join(
                f"{n['role']}:{n['task_index']}@{n['host']}:{n['ports'][0]}" for n in nodes))
            states = _watch(server, nodes, heartbeat_timeout)
            server.stop(-1, 5000)
            _wait_exit(pid)
            yield pa.RecordBatch.from_pylist(
                [dict(index=n["index"], role=n["role"], task_index=n["task_index"],
                      host=n["host"], executor=n["executor_id"],
                      state=states[n["index"]][0], error=states[n["index"]][1])
                 for n in nodes],
                schema=pa.schema([("index", pa.int32()), ("role", pa.string()),
                                  ("task_index", pa.int32()), ("host", pa.string()),
                                  ("executor", pa.string()), ("state", pa.string()),
                                  ("error", pa.string())]))
        finally:
            if server is not None:
                server.stop(-1, 0)
                server.close()
            try:
                os.unlink(registry_path(boot["job_id"]))
            except OSError:
                pass
    return task


def _write_registry(job_id: str, nodes: List[Dict[str, Any]], encrypt: bool,
                    feed_roles: Tuple[str, ...]) -> None:
    path = registry_path(job_id)
    fed = [n for n in nodes if n["role"] in feed_roles]
    record = dict(nodes=nodes, encrypt=encrypt,
                  targets=[[n["host"], n["ports"][1], node_name(n)] for n in fed])
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _wait_exit(pid: int) -> None:
    """Waits for this task's node process (its child: spawn_node reaps it)."""
    try:
        while True:
            os.kill(pid, 0)
            time.sleep(0.1)
    except ProcessLookupError:
        return
    finally:  # the task was killed (its stage failed or was cancelled): so is the node
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _watch(server: Any, nodes: List[Dict[str, Any]], heartbeat_timeout: float
           ) -> Dict[int, Tuple[str, str]]:
    """Follows the nodes until every trainer is done or serving, or one node
    fails; returns each node's (state, error message)."""
    states: Dict[int, Tuple[str, str]] = {n["index"]: ("running", "") for n in nodes}
    by_index = {n["index"]: n for n in nodes}
    trainers = {n["index"] for n in nodes if n["role"] in TRAINER_ROLES}
    serving: set = set()
    while True:
        if trainers <= {i for i, s in states.items() if s[0] == "done"} | serving:
            break
        ev = server.next_event(0.5)
        if ev is None:
            continue
        kind, node, code, text = ev
        if kind == "progress":
            if code == SERVING_REPORT:
                serving.add(node)
            elif code not in (RESUME_REPORT, CHECKPOINT_REPORT):
                logger.info(f"{node_name(by_index[node])}: {text}")
        elif kind == "rejected":
            logger.warning(text)
        elif kind == "done":
            states[node] = ("done", "")
        elif kind in ("failed", "lost"):
            what = (f"failed with exit code {code}" if kind == "failed"
                    else "was lost (control connection dropped or heartbeats "
                         f"stopped for {heartbeat_timeout:.0f} s)")
            msg = f"ember {node_name(by_index[node])} {what}" + (f":\n{text}" if text else "")
            states[node] = (kind, msg)
            break
    return {i: (s if s[0] != "running" else ("stopped", "")) for i, s in states.items()}


def _registry(job_id: str, timeout: float) -> Dict[str, Any]:
    """The cluster's nodes as this host's node stage task wrote them."""
    path = registry_path(job_id)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise EmberError(
                    f"ember over Spark Connect: no node of job {job_id} on host "
                    f"{socket.gethostname()} within {timeout:.0f} s ({path} is missing). "
                    "Feeding tasks find the nodes through the node on their host: run as "
                    "many nodes as the cluster has executor hosts, and check the node "
                    "stage's tasks started (the executor logs)") from None
            time.sleep(0.2)


def feeder(job_id: str, secret: bytes, seq: int, timeout: float, first: int, parts: int,
           per_epoch: int, qname: str, chunk_bytes: int, tensors: Dict[str, Any],
           wait: float) -> Callable[[Any], Any]:
    """``train(df)``'s feeding task: :func:`ember.executor.arrow_feeder` with
    the targets read from this host's registry."""
    def feed(batches: Any) -> Any:
        reg = _registry(job_id, wait)
        call = FeedCall(tuple((h, int(p), name) for h, p, name in reg["targets"]), secret,
                        seq, timeout, first=first, parts=parts, per_epoch=per_epoch,
                        qname=qname, encrypt=bool(reg["encrypt"]))
        yield from executor.arrow_feeder(call, chunk_bytes, tensors)(batches)
    return feed


def inferrer(job_id: str, secret: bytes, seq: int, timeout: float, qname: str,
             chunk_bytes: int, tensors: Dict[str, Any], wait: float,
             result_schema: Any) -> Callable[[Any], Any]:
    """``inference(df)``'s task: partition ``p``'s rows go to fed node
    ``p % n``; yields the node's results in order, as ``result_schema``'s
    columns (the node's result columns, in order)."""
    def infer(batches: Any) -> Any:
        import numpy as np
        import pyarrow as pa
        from pyspark import TaskContext

        from ember import _columns

        ctx = TaskContext.get()
        assert ctx is not None
        p = ctx.partitionId()
        reg = _registry(job_id, wait)
        call = FeedCall(tuple((h, int(port), name) for h, port, name in reg["targets"]),
                        secret, seq, timeout, want_results=True, qname=qname,
                        encrypt=bool(reg["encrypt"]))
        client = executor.partition_client(call, p)
        sent = 0
        try:
            for rb in batches:
                step = max(1, chunk_bytes // max(1, rb.nbytes // max(1, rb.num_rows)))
                for off in range(0, rb.num_rows, step):
                    cols, n = _columns.arrow_to_columns(
                        rb.slice(off, step), where=f"inference partition {p}",
                        tensors=tensors, first=sent)
                    client.send(cols, n, timeout)
                    sent += n
                    got = 0
                    while got < n:
                        item = client.recv_results(timeout)
                        _names, columns = _columns.item_columns(item)
                        arrays = []
                        for col, field in zip(columns, result_schema):
                            col = np.asarray(col)
                            if col.ndim > 1:
                                flat = pa.array(np.ascontiguousarray(col).reshape(-1))
                                arrays.append(pa.FixedSizeListArray.from_arrays(
                                    flat, int(np.prod(col.shape[1:]))).cast(field.type))
                            else:
                                arrays.append(pa.array(col).cast(field.type))
                        yield pa.RecordBatch.from_arrays(arrays, schema=result_schema)
                        got += item.nrows
            client.end_partition(timeout)
        except Exception as exc:
            if isinstance(exc, _ember.EmberError):
                raise executor._in_feed_context(call, p, exc) from exc
            raise
        finally:
            client.close()
    return infer


def end_feeds(job_id: str, secret: bytes, wait: float) -> Callable[[Any], Any]:
    """``shutdown()``'s task: ends every fed node's feed (END_FEED), as a
    classic driver does; a node already gone has nothing to end."""
    def end(_batches: Any) -> Any:
        import pyarrow as pa

        reg = _registry(job_id, wait)
        ended = 0
        for host, port, name in reg["targets"]:
            try:
                client = _ember.FeedClient(host, int(port), secret, 0xFFFFFFFF,
                                           encrypt=bool(reg["encrypt"]), timeout_s=10.0)
                try:
                    client.end_feed(10.0)
                    ended += 1
                finally:
                    client.close()
            except _ember.EmberError as exc:
                logger.info(f"end of feed not delivered to {name}: {exc}")
        yield pa.RecordBatch.from_pydict({"ended": pa.array([ended], pa.int64())})
    return end
