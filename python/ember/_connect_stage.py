"""The executor side of Ember over Spark Connect (:mod:`ember.connect`).

A Connect client may sit outside the cluster, so nothing here connects to
it.  The nodes start in one barrier ``mapInArrow`` stage (:func:`launcher`):
its task 0 starts the cluster's coordinator (:mod:`ember._connect_coordinator`,
what a classic driver hosts: the rendezvous and the nodes' watch) as a
detached process on its host, ``BarrierTaskContext.allGather`` hands its
address to every task, and each task spawns its node, as a classic barrier
task does, and returns once it registered.  Task 0's rows are the
registered nodes and the coordinator's control address: the client feeds the
nodes and asks the coordinator through later jobs (:func:`control`), whose
tasks can reach both.  The job secret travels in the closures.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Callable, Dict, Iterator, Tuple

from ember import _ember, _gpu, executor
from ember.executor import FeedCall

#: the node stage's rows (task 0's): one per node, and where its coordinator listens
NODE_SCHEMA = ("index int, role string, task_index int, host string, executor string, "
               "feed_port int, ports string, pid long, coordinator string")


def _spawn_coordinator(boot: Dict[str, Any], start_timeout: float) -> Tuple[Any, int, int]:
    """Starts the coordinator (detached, own session); returns (process, its
    rendezvous port, its control port)."""
    proc = executor.spawn_detached(
        ["-m", "ember._connect_coordinator"], json.dumps(boot).encode(),
        dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    line = executor.read_line(proc, start_timeout)
    if not line.startswith("ports "):
        raise RuntimeError(f"ember: the cluster's coordinator did not start: "
                           f"{line or 'no answer'} (its stderr is in the executor's log)")
    _, rv, ctl = line.split()
    return proc, int(rv), int(ctl)


def launcher(boot: Dict[str, Any], num_nodes: int, roles: Dict[str, Any],
             reservation_timeout: float, heartbeat_timeout: float,
             feed_roles: Tuple[str, ...]) -> Callable[[Any], Iterator[Any]]:
    """The barrier stage's task: node ``partition id``; task 0 also starts
    the coordinator and yields the registered nodes."""
    def task(_batches: Any) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        tc = BarrierTaskContext.get()
        part = tc.partitionId()
        infos = tc.getTaskInfos()
        address = infos[part].address if part < len(infos) else ""
        host = executor.host_of(address) or socket.gethostname()
        coordinator = None
        told = ""
        if part == 0:
            coordinator, rv_port, ctl_port = _spawn_coordinator(dict(
                secret=boot["secret"].hex(), num_nodes=num_nodes, roles=roles, host=host,
                heartbeat_timeout=heartbeat_timeout, reservation_timeout=reservation_timeout,
                encrypt=bool(boot["encrypt"]), feed_roles=list(feed_roles)),
                reservation_timeout)
            told = json.dumps([host, rv_port, ctl_port])
        try:
            rv_host, rv_port, ctl_port = json.loads(tc.allGather(told)[0])
        except BaseException:
            if coordinator is not None:
                coordinator.kill()
            raise
        gpu = tc.resources().get(_gpu.GPU)
        gpus = [str(a) for a in gpu.addresses] if gpu is not None else []
        executor.spawn_node(dict(boot, index=part, sys_path=list(sys.path), gpus=gpus,
                                 executor_id=address or str(part), advertise_host=host,
                                 driver_host=rv_host, driver_port=rv_port),
                            reservation_timeout)
        if coordinator is None:
            return
        line = executor.read_line(coordinator, reservation_timeout)
        if not line.startswith("ready "):
            coordinator.kill()
            raise RuntimeError(f"ember: the nodes did not all register: {line[7:] or line}")
        nodes = json.loads(line[6:])
        where = f"{rv_host}:{ctl_port}"
        yield pa.RecordBatch.from_pylist(
            [dict(index=n["index"], role=n["role"], task_index=n["task_index"],
                  host=n["host"], executor=n["executor_id"], feed_port=n["ports"][1],
                  ports=json.dumps(n["ports"]), pid=n["pid"], coordinator=where)
             for n in nodes],
            schema=pa.schema([("index", pa.int32()), ("role", pa.string()),
                              ("task_index", pa.int32()), ("host", pa.string()),
                              ("executor", pa.string()), ("feed_port", pa.int32()),
                              ("ports", pa.string()), ("pid", pa.int64()),
                              ("coordinator", pa.string())]))
    return task


def control(host: str, port: int, secret: bytes, encrypt: bool, seq: int,
            request: Dict[str, Any], timeout: float) -> Callable[[Any], Iterator[Any]]:
    """A one-task job's function: sends ``request`` to the coordinator and
    yields its JSON reply (one row ``reply``)."""
    def ask(_batches: Any) -> Iterator[Any]:
        import pyarrow as pa

        reply = executor.ask_coordinator((host, port), secret, encrypt, seq, request, timeout)
        yield pa.RecordBatch.from_pydict({"reply": pa.array([json.dumps(reply)], pa.string())})
    return ask


def inferrer(call: FeedCall, chunk_bytes: int, tensors: Dict[str, Any],
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
        timeout = call.timeout
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
