"""What :mod:`ember.spark` runs on the executors: the nodes' launch and the feeding tasks.

These functions run in Spark's Python workers (and :func:`spawn_node` also on
the driver host, for ``driver_ps_nodes``).  They are module-level, so that the
closures the driver pickles for a task (:func:`launcher`, :func:`rdd_feeder`,
:func:`arrow_feeder`) find them by import on every executor, and they close
over plain data only: a :class:`FeedCall` describes one feed call to its
feeding tasks.  The driver side is :mod:`ember.driver`.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ember import _ember, _gpu, _routing
from ember.errors import EmberFeedError, EmberNodeError, from_core, in_context

#: A fed node as its feeding tasks reach it: (host, feed port, name for messages).
Target = Tuple[str, int, str]


@dataclass(frozen=True)
class FeedCall:
    """One feed call (a ``train()`` or ``inference()``) as its feeding tasks see it.

    :param targets: the fed nodes (chief and workers, in index order); partition
        ``p`` goes to ``targets[p % len(targets)]``, or as ``routes`` say.
    :param secret: the job secret the nodes' feed servers check.
    :param seq: the call's id (the feed's 64-bit call number).
    :param timeout: seconds each feed operation may wait (``feed_timeout``).
    :param want_results: ``inference()``: the node answers every record.
    :param first: ``train()``: the call's first partition (after a restart, the
        first of the epoch the nodes resume from).
    :param parts: ``train()``: the end of the call's partitions; task ``i``
        feeds partition ``first + i``, of epoch ``p // per_epoch``.
    :param per_epoch: partitions per epoch (0: not told to the nodes).
    :param routes: ``train()``: the fed node of each of the data's partitions,
        the same every epoch (:mod:`ember._routing`); None: round-robin.
    :param grouped: task ``i`` feeds fed node ``i`` all its partitions of the
        call, one after the other (:mod:`ember._grouping`).
    :param labelled: every row names its partition of the call
        (``_grouping.PARTITION_COLUMN``, counted from ``first``) and a task
        feeds the partitions its rows name, in their order (Spark Connect's
        epochs, however Spark lays out their union).
    :param qname: the node queue the data is for (``ember.compat.tfos``).
    :param stream: the call is one micro-batch of a continuous stream (a
        DStream, or ``ember.compat.tfos``): the node's reading goes on past its end.
    :param micro_batch: the call is this micro-batch of ``Cluster.train_stream``'s
        query: one round of the node's feed (``DataFeed.micro_batches``).
    :param report: (driver host, port, secret) of the channel where a feeding
        task reports input the feed cannot carry (:func:`report_feed_error`).
    :param encrypt: the nodes' feed servers take encrypted connections only.
    :param coordinator: (host, control port) of the cluster's coordinator
        (Spark Connect, :mod:`ember._connect_coordinator`).  A task that cannot
        reach its node asks it whether that node failed, and if so fails at
        once: retrying until ``timeout`` would hold the task's slot, which the
        client's questions to the coordinator may need (a cluster with as many
        slots as nodes).
    """

    targets: Tuple[Target, ...]
    secret: bytes
    seq: int
    timeout: float
    want_results: bool = False
    first: int = 0
    parts: int = 0
    per_epoch: int = 0
    grouped: bool = False
    labelled: bool = False
    qname: str = "input"
    stream: bool = False
    report: Optional[Tuple[str, int, bytes]] = None
    micro_batch: Optional[int] = None
    encrypt: bool = False
    coordinator: Optional[Tuple[str, int]] = None
    routes: Optional[Tuple[int, ...]] = None

    def target(self, p: int) -> Target:
        """The node that gets partition ``p``."""
        return self.targets[_routing.node_of(p, len(self.targets), self.routes)]

    def node_partitions(self, node: int) -> List[int]:
        """The call's partitions that fed node ``node`` gets, in feeding order."""
        return _routing.node_partitions(node, self.first, self.parts, len(self.targets),
                                        self.routes)


# --------------------------------------------------------------------------- nodes

def spawn_node(node_boot: Dict[str, Any], start_timeout: float) -> int:
    """Starts one detached node process and waits until it has registered; returns its pid.

    The node runs ``python -m ember._trainer`` in its own session (so a STOP can
    kill its whole process group, and so can its watchdog when it is frozen
    for ``heartbeat_timeout``, see :mod:`ember._watchdog`); a reaper thread
    collects its exit status so no zombie outlives it.  A node whose
    ``main_fun`` imports a heavy framework (``node_boot["preload"]``) is
    forked, with it imported, from this host's fork server for its kind
    (:mod:`ember._forkserver`), as the same process would have been
    spawned.  The boot record crosses a local pipe, never a socket.  A node given GPUs
    (``node_boot["gpus"]``, its task's) sees only those, from its first
    instruction on (``CUDA_VISIBLE_DEVICES``).
    """
    from ember._imports import cloudpickle

    index = node_boot["index"]
    # main_fun may live in a module only this process can import: give the
    # node this process's path before it unpickles its boot record
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in node_boot["sys_path"] if p))
    gpus = node_boot.get("gpus") or []
    env.update(_gpu.cuda_env(gpus))
    # argv[1]: the node's watchdog kills it once it is frozen this long (ember._watchdog);
    # argv[2]: the node's index, for its log lines
    args = ["-m", "ember._trainer", str(node_boot.get("heartbeat_timeout", 0.0)), str(index)]
    boot = cloudpickle().dumps(node_boot)
    preload = node_boot.get("preload") or ()
    proc: Any = None
    from ember import _forkserver  # here: the feeding tasks' workers never need it

    if _forkserver.wanted(preload, gpus):
        # forked with its frameworks imported (in the environment it would
        # have imported them in: the job's env= too)
        proc = _forkserver.spawn(args, preload, env, dict(env, **node_boot.get("env", {})),
                                 start_timeout)
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.write(boot)
            proc.stdin.close()
    if proc is None:
        proc = spawn_detached(args, boot, env)
    line = read_line(proc, start_timeout)
    assert proc.stdout is not None
    proc.stdout.close()
    if line != "registered":
        if not line:
            # a node that died is being reaped (by a thread here or by its
            # fork server): its exit status, once known, says more than a kill
            deadline = time.monotonic() + 0.5
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        code = proc.poll()
        reason = line or (f"no answer within {start_timeout:.0f} s" if code is None else
                          f"exited with code {code} before registering (its stderr is in "
                          "the executor's log)")
        raise RuntimeError(f"ember node {index} failed to start: {reason}")
    return proc.pid


def spawn_detached(args: List[str], boot: bytes, env: Dict[str, str], stderr: Any = None,
                   cwd: Optional[str] = None) -> Any:
    """``python <args>`` in a session of its own (a STOP or a watchdog can
    kill its whole group), given ``boot`` on its stdin (a local pipe, never
    a socket), its stdout a pipe for its start-up lines; a reaper thread
    collects its exit status so no zombie outlives it.  ``stderr`` and
    ``cwd`` as ``subprocess.Popen``'s (default: this process's)."""
    import subprocess

    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, start_new_session=True,
                            env=env, cwd=cwd)
    threading.Thread(target=proc.wait, name=f"ember-reap-{proc.pid}", daemon=True).start()
    assert proc.stdin is not None
    proc.stdin.write(boot)
    proc.stdin.close()
    return proc


def read_line(proc: Any, timeout: float) -> str:
    """The next start-up line of a :func:`spawn_detached` process ('' if none
    comes within ``timeout``)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return str(proc.stdout.readline().decode(errors="replace").strip()) if ready else ""


def launcher(boot: Dict[str, Any], start_timeout: float) -> Callable[[Any], Any]:
    """The barrier task: node ``index_offset + partition id`` on this executor,
    given the GPUs Spark assigned to this task (none unless the stage asked)."""
    def launch(_: Any) -> Any:
        from pyspark import BarrierTaskContext

        tc = BarrierTaskContext.get()
        part = tc.partitionId()
        index = boot.get("index_offset", 0) + part
        infos = tc.getTaskInfos()
        gpu = tc.resources().get(_gpu.GPU)
        gpus = [str(a) for a in gpu.addresses] if gpu is not None else []
        address = infos[part].address if part < len(infos) else ""
        node_boot = dict(boot, index=index, sys_path=list(sys.path), gpus=gpus,
                         executor_id=address or str(index),
                         advertise_host=host_of(address) or socket.gethostname())
        pid = spawn_node(node_boot, start_timeout)
        yield (index, socket.gethostname(), pid, gpus)
    return launch


def node_name(node: Dict[str, Any]) -> str:
    """``node <i> (<role>:<task>, executor <id>, host <host>)``: how errors and logs name a node."""
    return (f"node {node['index']} ({node['role']}:{node['task_index']}, "
            f"executor {node['executor_id']}, host {node['host']})")


def node_failure(name: str, kind: str, code: int, text: Optional[str],
                 heartbeat_timeout: float) -> str:
    """The message of a node's failure as the rendezvous reports it: ``kind``
    "failed" (with its exit code) or "lost", and the node's own text."""
    what = (f"failed with exit code {code}" if kind == "failed"
            else "was lost (control connection dropped or heartbeats "
                 f"stopped for {heartbeat_timeout:.0f} s)")
    return f"ember {name} {what}" + (f":\n{text}" if text else "")


def host_of(address: str) -> str:
    """The host of Spark's ``host:port`` (``[v6]:port``) executor address."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# --------------------------------------------------------------------------- feeding tasks

def rdd_feeder(call: FeedCall, chunk_rows: int,
               upstream: Optional[Callable[[int, Any], Any]] = None,
               frames: bool = False,
               fail_at: Optional[Tuple[Any, ...]] = None) -> Callable[[Any], Any]:
    """The feeding task of an RDD (``mapPartitions``) for ``call``.  In train(),
    task ``i`` feeds partition ``p = call.first + i`` of the call, described to
    the node by its tag (:func:`partition_tag`); in inference() it yields the
    node's results, in order.

    ``call.grouped`` (train()): task ``i`` feeds fed node ``i`` all its
    partitions of the call, one after the other (:mod:`ember._grouping`), each
    as a task of its own would, and applies ``upstream`` (the source RDD's own
    Python pipeline, None for none) to each source partition.  ``chunk_rows``:
    records per feed batch (cut down to what a batch written in place takes).
    ``frames``: the grouped RDD's items are whole pickled batches
    (``_grouping.BoundaryDeserializer(frames=True)``), fed without unpickling
    them where they are of the common form (no ``upstream`` then).
    ``fail_at``: as for :func:`arrow_feeder` (tests only)."""
    def feed(iterator: Any) -> Any:
        from pyspark import TaskContext

        from ember import _grouping

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        task = ctx.partitionId()
        if call.grouped:
            work: Any = _grouping.partitions(iterator, call.node_partitions(task))
        else:
            work = [(call.first + task, iterator)]
        cut = {"rows": chunk_rows}

        def feed_one(p: int, records: Any, acks: Optional[_Acks]) -> Any:
            if upstream is not None:
                records = upstream(p - call.first, records)
            return (yield from _feed_rdd_partition(call, p, records, cut, acks, frames,
                                                   fail_at))

        # A feeding task holds a chunk of records while it converts them, so
        # with Python's gen-0 threshold (700 allocations) the cyclic GC ran
        # every few hundred records and walked the chunk each time: about 7%
        # of the task's CPU.  Collections stay on, only rarer, while it feeds.
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 50 * chunk_rows), *thresholds[1:])
        try:
            total = yield from _feed_partitions(call, work, feed_one)
        finally:
            gc.set_threshold(*thresholds)
        if not call.want_results:
            yield total
    return feed


def _feed_partitions(call: FeedCall, work: Any,
                     feed_one: Callable[[int, Any, Optional["_Acks"]], Any]) -> Any:
    """Feeds each ``(p, data)`` of ``work`` in turn with the generator
    ``feed_one(p, data, acks)`` (what it yields, inference results, is
    yielded; it returns (records, whether the node terminated its feed)),
    until the node terminates its feed; returns the records fed.  A train()
    task feeding several partitions (grouped or labelled) reads each one's
    ACK after feeding the next (:class:`_Acks`)."""
    acks = _Acks(call) if (call.grouped or call.labelled) and not call.want_results else None
    total = 0
    try:
        for p, data in work:
            sent, aborted = yield from feed_one(p, data, acks)
            total += sent
            if aborted or (acks is not None and acks.settle(keep=1)):
                break  # the node terminated its feed: TensorFlowOnSpark drops the rest
        else:
            if acks is not None:
                acks.settle(keep=0)
    finally:
        if acks is not None:
            acks.close()
    return total


class _Acks:
    """The partitions of a grouped feeding task whose end is sent but whose
    ACK is not yet read (``FeedClient.end_partition_send``).  The node
    acknowledges a partition once its trainer has read all of it: waiting
    for that before feeding the next partition drained the node's queue at
    every partition boundary, and the trainer waited for the next
    partition's connection and first batch (bench-train, between hosts).
    So the task reads a partition's ACK only after feeding the next one."""

    def __init__(self, call: FeedCall) -> None:
        self._call = call
        self._held: List[Tuple[int, Any]] = []

    def hold(self, p: int, client: Any) -> None:
        """Ends partition ``p`` on ``client`` without waiting for its ACK."""
        client.end_partition_send(self._call.timeout)
        self._held.append((p, client))

    def settle(self, keep: int) -> bool:
        """Reads the ACKs of all but the last ``keep`` held partitions;
        returns whether the node terminated its feed."""
        while len(self._held) > keep:
            p, client = self._held.pop(0)
            try:
                client.end_partition_wait(self._call.timeout)
            except _ember.EmberAborted:
                return True
            except Exception as exc:
                if from_core(exc):
                    raise _in_feed_context(self._call, p, exc) from exc
                raise
            finally:
                client.close()
        return False

    def close(self) -> None:
        """Drops what is still held (the task failed: Spark's retry resumes
        after what the node holds)."""
        for _, client in self._held:
            client.close()
        self._held.clear()


def _feed_rdd_partition(call: FeedCall, p: int, iterator: Any, cut: Dict[str, int],
                        acks: Optional[_Acks] = None, frames: bool = False,
                        fail_at: Optional[Tuple[Any, ...]] = None) -> Any:
    """Feeds partition ``p`` (yields its results in inference); returns
    (records fed or skipped as delivered, whether the node terminated its feed).
    ``cut["rows"]``: records per chunk, cut down to what a batch written in
    place takes (kept for the task's next partition).  ``acks``: the task's
    partitions awaiting their ACK, where this one's end goes (None: wait for
    it here).  ``frames``: ``iterator`` yields whole pickled batches
    (:func:`ember._grouping.frame_chunks`), not records."""
    from ember import _columns, _grouping

    client = partition_client(call, p)
    # a retried task skips what an earlier attempt already delivered
    skip, delivered = client.resume_point
    sent = 0
    layout: Dict[str, Any] = {}  # each column's type in this partition's first chunk
    try:
        chunks: Any
        if frames and delivered:
            sent, chunks = sum(len(frame) for frame in iterator), ()
        elif frames:
            sent, chunks = skip, _grouping.frame_chunks(iter(iterator), skip, cut)
        else:
            # chunks are cut by islice, in C: a Python step per record costs
            # the RDD path several percent of its throughput
            records = iter(iterator)
            if delivered:
                sent = sum(1 for _ in records)
            elif skip:
                sent = sum(1 for _ in itertools.islice(records, skip))
            chunks = iter(lambda: list(itertools.islice(records, cut["rows"])), [])
        for chunk in chunks:
            _inject_failure(fail_at, p, sent)
            n, nbytes = yield from _send(call, client, chunk, p, sent, layout)
            sent += n
            cut["rows"] = _columns.rows_in_place(client.in_place_max, cut["rows"], n, nbytes)
        if acks is None:
            client.end_partition(call.timeout)
        else:
            acks.hold(p, client)
            client = None  # acks closes it
    except _ember.EmberAborted:
        return sent, True
    except Exception as exc:
        if from_core(exc):  # the connection to the node, not the input
            raise _in_feed_context(call, p, exc) from exc
        # a broken input stream: a stage upstream failed, and Spark reports
        # that; the node sees the connection drop, as after a kill
        _partition_failed(call, client, p, sent, exc,
                          tell_node=not isinstance(exc, _grouping.InputBroken))
        raise
    finally:
        if client is not None:
            client.close()
    return sent, False


def _send(call: FeedCall, client: Any, chunk: Any, p: int, at: int,
          layout: Dict[str, Any]) -> Any:
    """Sends records ``at..`` of partition ``p`` (their index names a bad one;
    a chunk as :func:`ember._columns.send_records` takes it), yielding their
    results in inference; returns (the records sent, the bytes of their
    columns, 0: unknown)."""
    from ember import _columns

    n, nbytes = _columns.send_records(client, chunk, f"feeding partition {p}", at, layout,
                                      call.timeout)
    if call.want_results:
        got = 0
        while got < n:
            item = client.recv_results(call.timeout)
            names, columns = _columns.item_columns(item)
            yield from _columns.rows_of(names, columns, 0, item.nrows)
            got += item.nrows
        if got != n:
            raise RuntimeError(f"partition {p}: node returned {got} results for {n} records")
    return n, nbytes


def arrow_feeder(call: FeedCall, chunk_bytes: int, tensors: Dict[str, Any],
                 fail_at: Optional[Tuple[Any, ...]] = None) -> Callable[[Any], Any]:
    """The feeding task of a DataFrame (``mapInArrow``) for ``call`` (train()):
    Arrow record batches go to the node as columnar batches of about
    ``chunk_bytes``, their buffers encoded straight from Arrow memory (no
    Python object per value); ``tensors`` are the tensor columns' specs
    (:func:`ember.tensors.tensor_specs`).  Yields one row: the records fed.
    Partitions as for :func:`rdd_feeder` (grouped, the rows carry their
    partition: ``_grouping.PARTITION_COLUMN``).

    ``fail_at``, tests only: (partition, rows): the task raises on its first
    attempt after sending that many rows; (partition, rows, dir): it writes
    its pid to ``dir/pid-<partition>`` and waits to be killed."""
    def feed(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        from ember import _grouping

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        task = ctx.partitionId()
        source = _Input(batches)
        if call.grouped and task >= len(call.targets):
            raise RuntimeError(f"grouped feed: task {task} has no node to feed (the input has "
                               f"more partitions than the {len(call.targets)} fed nodes)")
        if call.labelled:
            work: Any = _grouping.arrow_partitions(source, None, call.first)
        elif call.grouped:
            work = _grouping.arrow_partitions(source, call.node_partitions(task), call.first)
        else:
            work = [(call.first + task, source)]
        def feed_one(p: int, rbs: Any, acks: Optional[_Acks]) -> Any:
            return _feed_arrow_partition(call, p, rbs, source, chunk_bytes, tensors, fail_at,
                                         acks)
            yield  # a generator, as _feed_partitions takes: it yields nothing

        total = yield from _feed_partitions(call, work, feed_one)
        yield pa.RecordBatch.from_pydict({"fed": pa.array([total], pa.int64())})
    return feed


def _feed_arrow_partition(call: FeedCall, p: int, rbs: Any, source: "_Input", chunk_bytes: int,
                          tensors: Dict[str, Any], fail_at: Optional[Tuple[Any, ...]],
                          acks: Optional[_Acks] = None) -> Tuple[int, bool]:
    """Feeds partition ``p``'s record batches; returns (rows fed or skipped as
    delivered, whether the node terminated its feed).  ``acks``: as for
    :func:`_feed_rdd_partition`."""
    from ember import _columns

    client = partition_client(call, p)
    # a retried task skips what an earlier attempt already delivered
    skip, delivered = client.resume_point
    sent = 0
    layout: Dict[str, Any] = {}  # each array column's width in this partition
    try:
        for rb in rbs:
            if delivered or skip >= rb.num_rows:
                skip -= 0 if delivered else rb.num_rows
                sent += rb.num_rows
                continue
            if skip:
                rb, sent, skip = rb.slice(skip), sent + skip, 0
            row_bytes = max(1, rb.nbytes // rb.num_rows)
            step = max(1, chunk_bytes // row_bytes)
            for off in range(0, rb.num_rows, step):
                _inject_failure(fail_at, p, sent)
                part = rb.slice(off, step)
                cols, n = _columns.arrow_to_columns(
                    part, where=f"feeding partition {p}", tensors=tensors, first=sent,
                    layout=layout)
                client.send(cols, n, call.timeout)
                sent += n
        if acks is None:
            client.end_partition(call.timeout)
        else:
            acks.hold(p, client)
            client = None  # acks closes it
    except _ember.EmberAborted:
        return sent, True
    except Exception as exc:
        if from_core(exc):  # the connection to the node, not the input
            raise _in_feed_context(call, p, exc) from exc
        # When Spark breaks the input stream, another stage of this task
        # failed (a Python UDF upstream, ember.tensors.pack) and Spark
        # reports that stage's error; the node would only log the
        # stream's ArrowInvalid.  Its connection drops, as after a kill:
        # Spark's retry resumes after the records it holds.
        _partition_failed(call, client, p, sent, exc, tell_node=not source.broke)
        raise
    finally:
        if client is not None:
            client.close()
    return sent, False


def _inject_failure(fail_at: Optional[Tuple[Any, ...]], p: int, sent: int) -> None:
    """Tests only: fails partition ``p``'s first attempt once ``sent`` records
    are sent, as ``fail_at`` says (see :func:`arrow_feeder`)."""
    if fail_at and p == fail_at[0] and sent >= fail_at[1] and _attempt_number() == 0:
        if len(fail_at) > 2:  # (p, rows, dir): wait to be SIGKILLed
            _wait_to_be_killed(fail_at[2], p)
        raise RuntimeError(f"injected failure of partition {p} after {sent} rows")


def _attempt_number() -> int:
    """This Spark task's attempt number (0 for the first)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None  # a Spark task
    return ctx.attemptNumber()


def _in_feed_context(call: FeedCall, p: int, exc: Any) -> Any:
    """A libember error of partition ``p``'s connection, its message naming the
    partition and the node (:func:`ember.errors.in_context`)."""
    host, port, name = call.target(p)
    return in_context(exc, f"feeding partition {p} to {name} at {host}:{port}")


def _fail_partition(client: Any, p: int, at: int, exc: BaseException, timeout: float) -> None:
    """Tells the node this partition's task failed (the node logs it, or raises
    it in the trainer with on_producer_error="raise"); the task still fails."""
    try:
        client.fail(f"partition {p} failed after {at} records: {type(exc).__name__}: {exc}",
                    min(timeout, 10.0))
    except _ember.EmberError:
        pass  # the node is gone or the connection broke: the task's own error says enough


def _partition_failed(call: FeedCall, client: Any, p: int, sent: int, exc: BaseException,
                      tell_node: bool = True) -> None:
    """A feeding task's own error: input the feed cannot carry reaches the
    driver at once (:func:`report_feed_error`), and the node gets the
    partition's failure notice (:func:`_fail_partition`) unless ``tell_node``
    is false."""
    if isinstance(exc, EmberFeedError):
        report_feed_error(call.report, call.seq, p, exc, encrypt=call.encrypt)
    if tell_node:
        _fail_partition(client, p, sent, exc, call.timeout)


def report_feed_error(report: Optional[Tuple[str, int, bytes]], seq: int, p: int,
                      exc: BaseException, encrypt: bool = False) -> None:
    """Tells the driver at once that this partition holds input the feed cannot
    carry (its report channel, see ``Cluster._report_channel``).  Such an
    error is deterministic, so the driver cancels the job instead of waiting
    for Spark's retries of this task to fail the same way."""
    if report is None:
        return
    host, port, secret = report
    try:
        client = _ember.FeedClient(host, port, secret, p, call=seq, timeout_s=5.0, shm=False,
                                   encrypt=encrypt)
        try:
            client.fail(str(exc)[:1000], 5.0)
        finally:
            client.close()
    except _ember.EmberError:
        pass  # the driver learns it from Spark instead, as fast as Spark tells it


def partition_client(call: FeedCall, p: int) -> Any:
    """A feeding task's connection for partition ``p`` of ``call`` to the node
    that gets it: described by its tag, with the number of the call's
    partitions that node gets (train()), resuming what an earlier attempt
    delivered (train()) or asking for results (inference()).  With
    ``call.coordinator``, a node not reached within ``_NODE_CHECK_S`` is
    asked after there, and its failure raised (:class:`EmberNodeError`)."""
    host, port, name = call.target(p)
    nodes = len(call.targets)

    def connect(timeout: float) -> Any:
        return _ember.FeedClient(
            host, port, call.secret, p, want_results=call.want_results, timeout_s=timeout,
            encrypt=call.encrypt,
            resume=not call.want_results, call=call.seq,
            call_partitions=0 if call.want_results else _routing.node_share(
                p, call.first, call.parts, nodes, call.routes),
            tag=partition_tag(call.per_epoch, call.first, call.parts, nodes, call.qname,
                              call.want_results, call.stream, call.micro_batch, call.routes))

    if call.coordinator is None:
        return connect(call.timeout)
    deadline = time.monotonic() + call.timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return connect(max(0.1, min(left, _NODE_CHECK_S)))
        except _ember.EmberTimeout:
            if left <= _NODE_CHECK_S:
                raise
        # a call id of its own: the server drops a second delivery of a
        # (call, partition) it has seen end
        reply = ask_coordinator(call.coordinator, call.secret, call.encrypt,
                                _COORDINATOR_CALL + random.getrandbits(60), {"op": "state"},
                                _NODE_CHECK_S * 5)
        failure = reply.get("failure")
        if failure:
            raise EmberNodeError(f"feeding partition {p} to {name} at {host}:{port}: the node "
                                 f"is gone: {failure['message']}", int(failure["node"]),
                                 str(failure["kind"]))


#: s a feeding task tries to reach its node before asking the coordinator
#: whether the node failed (FeedCall.coordinator)
_NODE_CHECK_S = 2.0
#: the feed call ids of the feeding tasks' questions to the coordinator
#: (this plus 60 random bits): apart from feed calls (counted from 1) and
#: the client's own questions (from 1 << 62)
_COORDINATOR_CALL = 1 << 61


def ask_coordinator(address: Tuple[str, int], secret: bytes, encrypt: bool, seq: int,
                    request: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """The answer of the cluster's coordinator (Spark Connect) to ``request``:
    one JSON record over its control channel, which is a feed server taking
    inference-style requests (:mod:`ember._connect_coordinator`).  Runs in a
    Spark task."""
    host, port = address
    call = FeedCall(((host, port, "the cluster's coordinator"),), secret, seq, timeout,
                    want_results=True, encrypt=encrypt)
    replies = list(rdd_feeder(call, 1)(iter([(json.dumps(request),)])))
    reply = replies[0]
    return dict(json.loads(str(reply[0] if isinstance(reply, (list, tuple)) else reply)))


def partition_tag(per_epoch: int, first: int, parts: int, nodes: int, qname: str,
                  want_results: bool, stream: bool, micro_batch: Optional[int] = None,
                  routes: Optional[Tuple[int, ...]] = None) -> bytes:
    """A partition's description for the node (the feed's START tag, read by
    ``DataFeed``): the node's queue, whether results are wanted, whether the
    call is one micro-batch of a stream, and in train() the plan: partitions
    per epoch (partition ``p`` is of epoch ``p // per_epoch``), the call's
    first and end partition and the number of fed nodes, so the node can tell
    when all its partitions of an epoch have ended (``DataFeed.epochs_done``),
    with the call's routes when it has them, and the stream micro-batch the
    call is."""
    tag: Dict[str, Any] = {"queue": qname, "results": want_results, "stream": stream}
    if micro_batch is not None:
        tag["micro_batch"] = micro_batch
    if per_epoch and not want_results:
        tag["plan"] = [per_epoch, first, parts, nodes]
        if routes:
            tag["routes"] = list(routes)
    return json.dumps(tag, separators=(",", ":")).encode()


class _Input:
    """Spark's input iterator of a feeding task; ``broke`` tells whether it raised."""

    def __init__(self, it: Any) -> None:
        self._it, self.broke = iter(it), False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self.broke = True
            raise


def _wait_to_be_killed(marker_dir: str, p: int) -> None:
    """Tests only: writes this Python worker's pid to ``marker_dir/pid-<p>`` and
    sleeps until the test SIGKILLs it (a feeding task killed mid-partition)."""
    path = os.path.join(marker_dir, f"pid-{p}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)
