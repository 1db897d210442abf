"""Run a TensorFlow/PyTorch ``main_fun`` on every node of a Spark job.

The 5-line version::

    from ember.spark import run, InputMode
    cluster = run(sc, main_fun, args, num_executors=2, input_mode=InputMode.SPARK)
    cluster.train(rdd, num_epochs=3)
    predictions = cluster.inference(test_rdd)   # (a second cluster, in inference mode)
    cluster.shutdown()

``run`` starts the C rendezvous server with a fresh secret, launches one node
per barrier task (gang-scheduled: all start or none), waits until every node
has registered (or raises naming the missing ones), and returns a
:class:`Cluster`.  Node failures reach the driver over the control channel:
their tracebacks are re-raised from ``train``, ``inference`` waits and
``shutdown``.
"""

from __future__ import annotations

import enum
import gc
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from ember import _ember, _gpu
from ember import mlflow as _mlflow
from ember._env import bind_host
from ember.errors import EmberFeedError, find_feed_error
from ember.node import RESUME_REPORT
from ember.tensors import tensor_specs

FEED_ROLES = ("chief", "worker")
_MAX_PARTITIONS = 1 << 32  # partitions of one feed call (the feed's u32 partition id)
_CONNECT_ATTEMPT = 1.0  # s: a driver's connect to a node, between looks at its liveness


class InputMode(enum.IntEnum):
    """How data reaches the trainers (TensorFlowOnSpark's InputMode)."""

    TENSORFLOW = 0  #: main_fun reads its own files (TFRecords, ...)
    SPARK = 1  #: cluster.train(rdd) pushes partitions into the nodes' feeds


#: How a collective (and the feed) words a peer that vanished mid-operation:
#: a node failing with it is more likely the casualty of another node's loss
#: than its cause.
_PEER_VANISHED = "failed, was killed or left)"
#: How long the driver waits for the cause of a failure that only reports a
#: vanished peer (the lost node's control connection drops at about the same
#: moment, see Cluster._failure).
_CAUSE_GRACE = 3.0


class EmberNodeError(RuntimeError):
    """A node failed (its main_fun raised, it exited, or it was lost)."""

    def __init__(self, message: str, node: int, kind: str = "failed") -> None:
        super().__init__(message)
        self.node = node
        self.kind = kind  #: "failed" (main_fun raised or the node exited) or "lost"
        self.seen_at = time.monotonic()  #: when the driver learnt of it (time.monotonic)

    @property
    def peer_vanished(self) -> bool:
        """True when the node failed only because a peer vanished under it."""
        return self.kind == "failed" and _PEER_VANISHED in str(self)


def _log(msg: str) -> None:
    print(f"[ember] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tasks
# These functions run on executors; they close over plain data only.

def _spawn_node(node_boot: Dict[str, Any], start_timeout: float) -> int:
    """Starts one detached node process and waits until it has registered; returns its pid.

    The node runs ``python -m ember._trainer`` in its own session (so a STOP can
    kill its whole process group, and so can its watchdog when it is frozen
    for ``heartbeat_timeout``, see :mod:`ember._watchdog`); a reaper thread
    collects its exit status so no zombie outlives it.  The boot record
    crosses a local pipe, never a socket.  A node given GPUs
    (``node_boot["gpus"]``, its task's) sees only those, from its first
    instruction on (``CUDA_VISIBLE_DEVICES``).
    """
    import select
    import subprocess

    from pyspark import cloudpickle

    index = node_boot["index"]
    # main_fun may live in a module only this process can import: give the
    # node this process's path before it unpickles its boot record
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in node_boot["sys_path"] if p))
    env.update(_gpu.cuda_env(node_boot.get("gpus") or []))
    # argv[1]: the node's watchdog kills it once it is frozen this long (ember._watchdog)
    proc = subprocess.Popen([sys.executable, "-m", "ember._trainer",
                             str(node_boot.get("heartbeat_timeout", 0.0))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True, env=env)
    threading.Thread(target=proc.wait, name=f"ember-reap-{proc.pid}", daemon=True).start()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cloudpickle.dumps(node_boot))
    proc.stdin.close()
    ready, _, _ = select.select([proc.stdout], [], [], start_timeout)
    line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    proc.stdout.close()
    if line != "registered":
        if not line:
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


def _launcher(boot: Dict[str, Any], start_timeout: float) -> Callable[[Any], Any]:
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
                         advertise_host=_host_of(address) or socket.gethostname())
        pid = _spawn_node(node_boot, start_timeout)
        yield (index, socket.gethostname(), pid, gpus)
    return launch


def _host_of(address: str) -> str:
    """The host of Spark's ``host:port`` (``[v6]:port``) executor address."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _driver_bind(conf: Any) -> str:
    """Where the driver's servers listen: Spark's own choice for the driver
    (``spark.driver.bindAddress``, else ``spark.driver.host``), so they are
    reachable exactly where Spark's driver is (see ember._env.bind_host)."""
    return bind_host(conf.get("spark.driver.bindAddress", None)
                     or conf.get("spark.driver.host", None) or "")


def _feeder(targets: List[Any], secret: bytes, seq: int, feed_timeout: float,
            chunk_rows: int, want_results: bool, parts: int = 0,
            report: Optional[Tuple[str, int, bytes]] = None, first: int = 0,
            per_epoch: int = 0, grouped: bool = False,
            upstream: Optional[Callable[[int, Any], Any]] = None, qname: str = "input",
            stream: bool = False) -> Callable[[Any], Any]:
    """The feeding task of an RDD for feed call ``seq``.  In train(), task ``i``
    feeds partition ``p = first + i`` of the call (``parts`` ends that range;
    its epoch is ``p // per_epoch``), described to the node by its tag
    (:func:`_partition_tag`).

    ``grouped`` (train()): task ``i`` feeds fed node ``i`` all its partitions
    of the call, one after the other (:mod:`ember._grouping`), each as a task
    of its own would, and applies ``upstream`` (the source RDD's own Python
    pipeline, None for none) to each source partition."""
    def feed(iterator: Any) -> Any:
        from pyspark import TaskContext

        from ember import _grouping

        task = TaskContext.get().partitionId()
        if grouped:
            work: Any = _grouping.partitions(iterator, _grouping.node_partitions(
                task, first, parts, len(targets)))
        else:
            work = [(first + task, iterator)]
        total = 0
        cut = {"rows": chunk_rows}
        # A feeding task holds a chunk of records while it converts them, so
        # with Python's gen-0 threshold (700 allocations) the cyclic GC ran
        # every few hundred records and walked the chunk each time: about 7%
        # of the task's CPU.  Collections stay on, only rarer, while it feeds.
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 50 * chunk_rows), *thresholds[1:])
        try:
            for p, records in work:
                if upstream is not None:
                    records = upstream(p - first, records)
                sent, aborted = yield from feed_partition(p, records, cut)
                total += sent
                if aborted:
                    break  # the node terminated its feed: TensorFlowOnSpark drops the rest
        finally:
            gc.set_threshold(*thresholds)
        if not want_results:
            yield total

    def feed_partition(p: int, iterator: Any, cut: Dict[str, int]) -> Any:
        """Feeds partition ``p`` (yields its results in inference); returns
        (records fed or skipped as delivered, whether the node terminated its feed).
        ``cut["rows"]``: records per chunk, cut down to what a batch written in
        place takes (kept for the task's next partition)."""
        from ember import _columns, _grouping

        host, port, name = targets[p % len(targets)]
        client = _partition_client(targets, secret, seq, p, feed_timeout, want_results, first,
                                   parts, per_epoch, qname, stream)
        # a retried task skips what an earlier attempt already delivered
        skip, delivered = client.resume_point
        sent = 0
        layout: Dict[str, Any] = {}  # each column's type in this partition's first chunk
        try:
            # chunks are cut by islice, in C: a Python step per record costs
            # the RDD path several percent of its throughput
            records = iter(iterator)
            if delivered:
                sent = sum(1 for _ in records)
            elif skip:
                sent = sum(1 for _ in itertools.islice(records, skip))
            while not delivered:
                chunk = list(itertools.islice(records, cut["rows"]))
                if not chunk:
                    break
                nbytes = yield from _send(client, chunk, p, sent, want_results, feed_timeout,
                                          layout)
                sent += len(chunk)
                cut["rows"] = _columns.rows_in_place(client.in_place_max, cut["rows"],
                                                     len(chunk), nbytes)
            client.end_partition(feed_timeout)
        except _ember.EmberAborted:
            return sent, True
        except _ember.EmberError as exc:
            raise RuntimeError(f"feeding partition {p} to {name} at {host}:{port}: {exc}") from exc
        except Exception as exc:
            # a broken input stream: a stage upstream failed, and Spark reports
            # that; the node sees the connection drop, as after a kill
            _partition_failed(client, report, seq, p, sent, exc, feed_timeout,
                              tell_node=not isinstance(exc, _grouping.InputBroken))
            raise
        finally:
            client.close()
        return sent, False

    def _send(client: Any, chunk: List[Any], p: int, at: int, want_results: bool,
              timeout: float, layout: Dict[str, Any]) -> Any:
        """Sends records ``at..`` of partition ``p`` (their index names a bad one);
        returns the bytes of their columns (0: unknown)."""
        from ember import _columns

        n, nbytes = _columns.send_records(client, chunk, f"feeding partition {p}", at, layout,
                                          timeout)
        if want_results:
            got = 0
            while got < n:
                item = client.recv_results(timeout)
                names, columns = _columns.item_columns(item)
                yield from _columns.rows_of(names, columns, 0, item.nrows)
                got += item.nrows
            if got != n:
                raise RuntimeError(f"partition {p}: node returned {got} results for {n} records")
        return nbytes
    return feed


def _fail_partition(client: Any, p: int, at: int, exc: BaseException, timeout: float) -> None:
    """Tells the node this partition's task failed (the node logs it, or raises
    it in the trainer with on_producer_error="raise"); the task still fails."""
    try:
        client.fail(f"partition {p} failed after {at} records: {type(exc).__name__}: {exc}",
                    min(timeout, 10.0))
    except _ember.EmberError:
        pass  # the node is gone or the connection broke: the task's own error says enough


def _partition_failed(client: Any, report: Optional[Tuple[str, int, bytes]], seq: int, p: int,
                      sent: int, exc: BaseException, timeout: float,
                      tell_node: bool = True) -> None:
    """A feeding task's own error: input the feed cannot carry reaches the
    driver at once (:func:`_report_feed_error`), and the node gets the
    partition's failure notice (:func:`_fail_partition`) unless ``tell_node``
    is false."""
    if isinstance(exc, EmberFeedError):
        _report_feed_error(report, seq, p, exc)
    if tell_node:
        _fail_partition(client, p, sent, exc, timeout)


def _report_feed_error(report: Optional[Tuple[str, int, bytes]], seq: int, p: int,
                       exc: BaseException) -> None:
    """Tells the driver at once that this partition holds input the feed cannot
    carry (its report channel, see ``Cluster._report_channel``).  Such an
    error is deterministic, so the driver cancels the job instead of waiting
    for Spark's retries of this task to fail the same way."""
    if report is None:
        return
    host, port, secret = report
    try:
        client = _ember.FeedClient(host, port, secret, p, call=seq, timeout_s=5.0, shm=False)
        try:
            client.fail(str(exc)[:1000], 5.0)
        finally:
            client.close()
    except _ember.EmberError:
        pass  # the driver learns it from Spark instead, as fast as Spark tells it


def _partition_client(targets: List[Any], secret: bytes, seq: int, p: int, timeout: float,
                      want_results: bool, first: int, parts: int, per_epoch: int, qname: str,
                      stream: bool) -> Any:
    """A feeding task's connection for partition ``p`` of feed call ``seq`` to
    the node that gets it: described by its tag, with the number of the
    call's partitions that node gets (train()), resuming what an earlier
    attempt delivered (train()) or asking for results (inference())."""
    host, port, _ = targets[p % len(targets)]
    nodes = len(targets)
    return _ember.FeedClient(
        host, port, secret, p, want_results=want_results, timeout_s=timeout,
        resume=not want_results, call=seq,
        call_partitions=0 if want_results else _node_share(p, first, parts, nodes),
        tag=_partition_tag(per_epoch, first, parts, nodes, qname, want_results, stream))


def _node_share(p: int, first: int, parts: int, nodes: int) -> int:
    """How many of the call's partitions ``first..parts-1`` (round-robin over
    ``nodes``) go to the node that gets partition ``p``: the feed ends the
    call for that node after as many partition ends (CALL_END, ember/feed.h)."""
    return len(range(first + (p - first) % nodes, parts, nodes))


def _partition_tag(per_epoch: int, first: int, parts: int, nodes: int, qname: str,
                   want_results: bool, stream: bool) -> bytes:
    """A partition's description for the node (the feed's START tag, read by
    ``DataFeed``): the node's queue, whether results are wanted, whether the
    call is one micro-batch of a stream, and in train() the plan: partitions
    per epoch (partition ``p`` is of epoch ``p // per_epoch``), the call's
    first and end partition and the number of fed nodes, so the node can tell
    when all its partitions of an epoch have ended (``DataFeed.epochs_done``)."""
    import json

    tag: Dict[str, Any] = {"queue": qname, "results": want_results, "stream": stream}
    if per_epoch and not want_results:
        tag["plan"] = [per_epoch, first, parts, nodes]
    return json.dumps(tag, separators=(",", ":")).encode()


def _arrow_feeder(targets: List[Any], secret: bytes, seq: int, feed_timeout: float,
                  chunk_bytes: int, parts: int, tensors: Dict[str, Any],
                  fail_at: Optional[Tuple[Any, ...]] = None,
                  report: Optional[Tuple[str, int, bytes]] = None, first: int = 0,
                  per_epoch: int = 0, grouped: bool = False, qname: str = "input",
                  stream: bool = False) -> Callable[[Any], Any]:
    """The feeding task of a DataFrame (``mapInArrow``): Arrow record batches go
    to the node as columnar batches, their buffers encoded straight from Arrow
    memory (no Python object per value).  Yields one row: the records fed.
    ``first``, ``parts``, ``per_epoch`` and ``grouped`` as for :func:`_feeder`
    (grouped, the rows carry their partition: ``_grouping.PARTITION_COLUMN``)."""
    def feed(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        from ember import _grouping

        task = TaskContext.get().partitionId()
        source = _Input(batches)
        if grouped:
            work: Any = _grouping.arrow_partitions(source, _grouping.node_partitions(
                task, first, parts, len(targets)), first)
        else:
            work = [(first + task, source)]
        total = 0
        for p, rbs in work:
            sent, aborted = feed_partition(p, rbs, source)
            total += sent
            if aborted:
                break  # the node terminated its feed: TensorFlowOnSpark drops the rest
        yield pa.RecordBatch.from_pydict({"fed": pa.array([total], pa.int64())})

    def feed_partition(p: int, rbs: Any, source: "_Input") -> Tuple[int, bool]:
        """Feeds partition ``p``'s record batches; returns (rows fed or skipped as
        delivered, whether the node terminated its feed)."""
        from pyspark import TaskContext

        from ember import _columns

        host, port, name = targets[p % len(targets)]
        client = _partition_client(targets, secret, seq, p, feed_timeout, False, first, parts,
                                   per_epoch, qname, stream)
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
                    if fail_at and p == fail_at[0] and sent >= fail_at[1] and \
                            TaskContext.get().attemptNumber() == 0:
                        if len(fail_at) > 2:  # (p, rows, dir): wait to be SIGKILLed
                            _wait_to_be_killed(fail_at[2], p)
                        raise RuntimeError(f"injected failure of partition {p} after {sent} rows")
                    part = rb.slice(off, step)
                    cols, n = _columns.arrow_to_columns(
                        part, where=f"feeding partition {p}", tensors=tensors, first=sent,
                        layout=layout)
                    client.send(cols, n, feed_timeout)
                    sent += n
            client.end_partition(feed_timeout)
        except _ember.EmberAborted:
            return sent, True
        except _ember.EmberError as exc:
            raise RuntimeError(f"feeding partition {p} to {name} at {host}:{port}: {exc}") from exc
        except Exception as exc:
            # When Spark breaks the input stream, another stage of this task
            # failed (a Python UDF upstream, ember.tensors.pack) and Spark
            # reports that stage's error; the node would only log the
            # stream's ArrowInvalid.  Its connection drops, as after a kill:
            # Spark's retry resumes after the records it holds.
            _partition_failed(client, report, seq, p, sent, exc, feed_timeout,
                              tell_node=not source.broke)
            raise
        finally:
            client.close()
        return sent, False
    return feed


def _grouping_class(sc: Any) -> Any:
    """Ember's grouping class in the JVM (see ember._grouping), or None, said
    once per driver, when Ember's Spark jar is missing."""
    from ember import _grouping

    groups = _grouping.java_class(sc)
    if groups is None and not _warned.get("jar"):
        _warned["jar"] = True
        from ember import _jars

        _log(f"warning: Ember's Spark jar ({_jars.SPARK_JAR}) is missing: train() feeds "
             "one Spark task per partition, and under a synchronous strategy a node can "
             "starve while Spark runs two tasks of another node (reinstall Ember)")
    return groups


_warned: Dict[str, bool] = {}


def _warn_few_slots(sc: Any, fed: int) -> None:
    """Warns when the cluster cannot run a feeding task for every fed node at once."""
    from ember import _grouping

    slots = _grouping.task_slots(sc)
    if slots is not None and slots < fed:
        _log(f"warning: train: the Spark cluster runs {slots} task(s) at once for {fed} fed "
             "nodes; each node's feeding task holds its slot until the node has taken all "
             "its data, so the nodes are fed one group at a time and a synchronous job "
             "(an all-reduce every step) waits for the feed timeout: give the job at least "
             f"{fed} task slots")


class _Input:
    """Spark's input iterator of a feeding task; ``broke`` tells whether it raised."""

    def __init__(self, it: Any) -> None:
        self._it, self.broke = iter(it), False

    def __iter__(self) -> "_Input":
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


# --------------------------------------------------------------------------- cluster

class Cluster:
    """A running Ember cluster: one node per barrier task.  Made by :func:`run`."""

    def __init__(self, sc: Any, main_fun: Callable[[Any, Any], Any], args: Any,
                 num_nodes: int, roles: Dict[str, Any], input_mode: InputMode,
                 reservation_timeout: float, heartbeat_timeout: float, max_restarts: int,
                 env: Dict[str, str], driver_ps_nodes: bool = False,
                 tensorboard: bool = False, log_dir: Optional[str] = None) -> None:
        self.sc = sc
        #: node index -> the GPU addresses Spark assigned to its barrier task
        #: (``TaskContext.resources()["gpu"]``, also the node's CUDA_VISIBLE_DEVICES)
        self.gpus: Dict[int, List[str]] = {}
        self._profile: Any = None  # the barrier stage's task ResourceProfile (gpus_per_node)
        self._mlflow: Optional[_mlflow.JobRun] = None  # the job's MLflow run (ember.mlflow)
        self._mlflow_end_on_shutdown = True  # EmberEstimator.fit ends the run itself
        self.input_mode = input_mode
        self.job_id = uuid.uuid4().hex[:12]
        self.nodes: List[Dict[str, Any]] = []
        self.chunk_rows = 1024  # records per feed batch from an RDD
        # tests only: (partition, rows): that DataFrame feeding task raises on
        # its first attempt after sending that many rows; (partition, rows,
        # dir): it writes its pid to dir/pid-<partition> and waits to be killed
        self._fault_feed_fail_at: Optional[Tuple[Any, ...]] = None
        # (FeedServer, secret) on the driver where feeding tasks report input
        # the feed cannot carry (EmberFeedError); made by the first train()
        self._reports: Any = None
        self.chunk_bytes = 4 << 20  # bytes per feed batch from a DataFrame's Arrow batches
        self.restarts = 0
        self.restart_causes: List[EmberNodeError] = []  # the failures that caused restarts
        self._main_fun, self._args, self._num_nodes, self._roles = main_fun, args, num_nodes, roles
        self._reservation_timeout = reservation_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._max_restarts = max_restarts
        self._env = env
        # TensorFlowOnSpark's driver_ps_nodes: the ps nodes (indexes 0..num_ps-1,
        # roles go in index order) run on the driver host, not in the barrier job
        self._driver_nodes = roles["num_ps"] if driver_ps_nodes else 0
        self._tensorboard = tensorboard
        self._log_dir = log_dir
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._feed_seq = 0
        self._server: Any = None
        self._closed = True

    # -- lifecycle -------------------------------------------------------------
    def _start(self) -> None:
        """Starts a rendezvous server, launches the nodes and waits for all of them."""
        sc, n = self.sc, self._num_nodes
        conf = sc.getConf()  # a copy of the whole conf through py4j: once
        # where the driver's servers listen, and the host nodes connect to
        self._driver_bind_host = _driver_bind(conf)
        self._driver_host = conf.get("spark.driver.host", socket.gethostname())
        self._secret = _ember.random_secret()
        self._server = server = _ember.RendezvousServer(
            self._secret, n, heartbeat_timeout_ms=int(self._heartbeat_timeout * 1000),
            host=self._driver_bind_host, **self._roles)
        self._state: Dict[int, str] = {}  # node -> running|done|failed|lost|stopping
        self._failures: List[EmberNodeError] = []
        # fed node -> the epoch its main_fun resumes from (ctx.resume_from), 0
        # when it read its feed without naming one (see _resume_epoch)
        self._resume: Dict[int, int] = {}
        self._launch_error: Optional[BaseException] = None
        self._closed = False
        self._monitor = threading.Thread(target=self._watch, args=(server,),
                                         name="ember-monitor", daemon=True)
        self._monitor.start()
        driver_host = self._driver_host
        boot = dict(driver_host=driver_host, driver_port=server.port, secret=self._secret,
                    main_fun=self._main_fun, args=self._args, input_mode=int(self.input_mode),
                    reservation_timeout=float(self._reservation_timeout),
                    heartbeat_interval_ms=max(100, int(self._heartbeat_timeout * 1000 / 5)),
                    heartbeat_timeout=float(self._heartbeat_timeout),
                    env=dict(self._env, EMBER_RESTART=str(self.restarts)),
                    working_dir=os.getcwd(), job_id=self.job_id,
                    index_offset=self._driver_nodes, tensorboard=self._tensorboard,
                    tensorboard_node=self._tensorboard_node(),
                    log_dir=self._log_dir or os.path.join(os.getcwd(), "tensorboard"))
        group = f"ember-{self.job_id}-launch-{self.restarts}"
        on_executors = n - self._driver_nodes

        self.gpus = {}

        def launch() -> None:
            sc.setJobGroup(group, f"ember: launch {on_executors} nodes", interruptOnCancel=True)
            try:
                for i in range(self._driver_nodes):
                    _spawn_node(dict(boot, index=i, sys_path=list(sys.path),
                                     executor_id="driver", advertise_host=driver_host),
                                self._reservation_timeout)
                rdd = sc.parallelize(range(on_executors), on_executors)
                if self._profile is not None:  # gpus_per_node: GPUs for this stage's tasks
                    rdd = rdd.withResources(self._profile)
                placed = rdd.barrier().mapPartitions(
                    _launcher(boot, self._reservation_timeout)).collect()
                self.gpus = {index: gpus for index, _host, _pid, gpus in placed}
            except BaseException as exc:
                self._launch_error = exc

        _log(f"job {self.job_id}: launching {n} node(s), rendezvous at {driver_host}:{server.port}"
             + (f" (restart {self.restarts})" if self.restarts else ""))
        self._launch_thread = threading.Thread(target=launch, name="ember-launch", daemon=True)
        self._launch_thread.start()
        deadline = time.monotonic() + self._reservation_timeout
        try:
            while True:
                try:
                    server.wait_ready(min(1.0, max(0.0, deadline - time.monotonic())))
                    break
                except _ember.EmberTimeout:
                    if self._launch_error is not None:
                        raise RuntimeError(f"ember: launching the nodes failed: "
                                           f"{self._launch_error}") from self._launch_error
                    if time.monotonic() >= deadline:
                        raise
        except BaseException:
            sc.cancelJobGroup(group)
            self._stop_all()
            raise
        self.nodes = sorted(server.nodes(), key=lambda node: node["index"])
        with self._lock:
            for node in self.nodes:
                self._state.setdefault(node["index"], "running")
        # every barrier task returns right after its node registered: their
        # results (the GPUs each task got) follow at once
        self._launch_thread.join(30)
        placement = ", ".join(
            f"{x['role']}:{x['task_index']}@{x['host']}:{x['ports'][0]}"
            + (f" gpus={','.join(self.gpus[x['index']])}" if self.gpus.get(x["index"]) else "")
            for x in self.nodes)
        _log("cluster ready: " + placement)
        if self._mlflow is not None:
            self._mlflow.set_tags({"ember.nodes": placement})

    def _restart_or_raise(self, failure: EmberNodeError) -> None:
        """After a node failure: relaunch every node (max_restarts), or raise."""
        if self.restarts >= self._max_restarts:
            # raise now: the healthy nodes end within the STOP's grace by
            # themselves, and a step they are in must not delay the error
            self._stop_all(wait=False)
            self._track_end("FAILED", failure)
            raise failure
        self.restarts += 1
        self.restart_causes.append(failure)
        if self._mlflow is not None:
            self._mlflow.log_metrics({"ember.restarts": self.restarts}, step=self.restarts)
            self._mlflow.set_tags(dict(
                _mlflow.failure_tags(f"ember.restart.{self.restarts}", failure.args[0]),
                **{f"ember.restart.{self.restarts}.node": failure.node}))
        _log(f"{failure.args[0].splitlines()[0]}; restarting the cluster "
             f"({self.restarts} of max_restarts={self._max_restarts}); main_fun resumes "
             "from its latest checkpoint")
        self._stop_all()
        self._start()

    # -- monitoring --------------------------------------------------------
    def _name(self, i: int) -> str:
        n = self.nodes[i] if i < len(self.nodes) else None
        if n is None:
            return f"node {i}"
        return f"node {i} ({n['role']}:{n['task_index']}, executor {n['executor_id']}, host {n['host']})"

    def _watch(self, server: Any) -> None:
        while True:
            try:
                ev = server.next_event(0.5)
            except ValueError:  # server closed
                return
            if ev is None:
                continue
            kind, node, code, text = ev
            if kind == "progress" and code == RESUME_REPORT:  # see _resume_epoch
                named = (text or "").isdigit()
                with self._lock:
                    self._resume[node] = int(text) if named else 0
                    self._changed.notify_all()
                if named:
                    _log(f"{self._name(node)}: resumes from epoch {text}")
            elif kind == "progress":
                _log(f"{self._name(node)}: {text}")
            elif kind == "rejected":
                _log(text)  # a whole line, rate-limited for strangers (C server)
            elif kind in ("done", "failed", "lost"):
                with self._lock:
                    if kind == "done":
                        self._state[node] = "done"
                    elif self._state.get(node) != "stopping":
                        self._state[node] = kind
                        what = (f"failed with exit code {code}" if kind == "failed"
                                else "was lost (control connection dropped or heartbeats "
                                     f"stopped for {self._heartbeat_timeout:.0f} s)")
                        msg = f"ember {self._name(node)} {what}"
                        if text:
                            msg += f":\n{text}"
                        self._failures.append(EmberNodeError(msg, node, kind))
                    self._changed.notify_all()

    def _failure(self) -> Optional[EmberNodeError]:
        with self._lock:
            while self._failures:
                # the first failure that is a cause, not a peer's casualty: when
                # a host dies, its peers' collectives break at once and they may
                # report before the lost node's connections are seen to drop
                causes = [f for f in self._failures if not f.peer_vanished]
                if causes:
                    return causes[0]
                first = self._failures[0]
                left = first.seen_at + _CAUSE_GRACE - time.monotonic()
                if left <= 0:
                    return first
                self._changed.wait(left)
            return None

    # -- jobs ----------------------------------------------------------------
    def _run_job(self, what: str, action: Callable[[], Any], seq: Optional[int] = None) -> Any:
        """Runs a Spark action in a thread; cancels it if a node fails meanwhile.

        Raises the node's :class:`EmberNodeError` (with its traceback) in preference
        to the feeding task's error it caused.  A feeding task of call ``seq``
        that met input the feed cannot carry cancels the job as soon as it
        reports it (Spark's retries would fail the same way): raises
        :class:`EmberFeedError` with Ember's message first, chained to
        Spark's exception when Spark's came first."""
        group = f"ember-{self.job_id}-{what.replace(' ', '-')}"
        result: Dict[str, Any] = {}

        def target() -> None:
            self.sc.setJobGroup(group, f"ember: {what}", interruptOnCancel=True)
            try:
                result["value"] = action()
            except BaseException as exc:  # re-raised in the caller's thread
                result["error"] = exc

        t = threading.Thread(target=target, name=f"ember-{what}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            feed_error = self._reported_feed_error(seq)
            if feed_error is not None:  # the cause, also of a node that raised on it
                t.join(0.2)  # a job Spark does not retry is failing by itself
                if t.is_alive():
                    self.sc.cancelJobGroup(group)
                    t.join(60)
                raise feed_error from result.get("error")
            failure = self._failure()
            if failure is not None:
                self.sc.cancelJobGroup(group)
                t.join(60)
                raise failure
        if "error" in result:
            message = find_feed_error(str(result["error"]))
            feed_error = EmberFeedError(message) if message else self._reported_feed_error(seq)
            if feed_error is not None:
                raise feed_error from result["error"]
        failure = self._failure()
        if failure is not None:
            raise failure
        if "error" in result:
            deadline = time.monotonic() + self._heartbeat_timeout + 2
            with self._lock:
                while not self._failures and time.monotonic() < deadline:
                    self._changed.wait(0.5)
            failure = self._failure()
            if failure is not None:
                raise failure from result["error"]
            raise result["error"]
        return result.get("value")

    def _report_channel(self) -> Tuple[str, int, bytes]:
        """(driver host, port, secret) of the feed server where feeding tasks
        report an :class:`EmberFeedError` (``_report_feed_error``): Ember's
        own authenticated channel, so the driver hears of it within
        milliseconds, not when Spark gives up retrying."""
        if self._reports is None:
            secret = _ember.random_secret()
            # a report is one FEED_ERROR of at most 1 KiB: small limits
            self._reports = (_ember.FeedServer(secret, shm=False, queue_bytes=1 << 20,
                                               max_frame=1 << 16, host=self._driver_bind_host),
                             secret, self._driver_host)
        server, secret, host = self._reports
        return host, server.port, secret

    def _reported_feed_error(self, seq: Optional[int]) -> Optional[EmberFeedError]:
        """The first EmberFeedError a feeding task of call ``seq`` reported, if any
        (reports of earlier calls, from their late retries, are dropped)."""
        if self._reports is None or seq is None:
            return None
        while True:
            item = self._reports[0].next(0)
            if item is None:
                return None
            if item.kind == "error" and item.call == seq:
                # the server's "feed: the producer of partition K failed: <report>"
                return EmberFeedError((item.reason or "").split(" failed: ", 1)[-1])

    def _feed_targets(self) -> List[Any]:
        return [(n["host"], n["ports"][1], self._name(n["index"]))
                for n in self.nodes if n["role"] in FEED_ROLES]

    def _next_seq(self) -> int:
        self._feed_seq += 1
        return self._feed_seq

    def train(self, data: Any, num_epochs: int = 1, feed_timeout: float = 600.0,
              qname: str = "input", stream: bool = False) -> int:
        """Feeds every record of ``data`` (RDD or DataFrame) ``num_epochs`` times.

        An RDD's records arrive as TensorFlowOnSpark's records (``batch[i]``)
        and as columns; a DataFrame goes through Spark's Arrow path
        (``mapInArrow``) and arrives as named columns (``batch.column(name)``):
        numbers, strings/binary, arrays of numbers (one length per column),
        ML vectors and tensor columns (:func:`ember.tensors.pack`: the fastest
        layout, see the README), each a numpy array with the row axis first.  With
        ``num_epochs > 1`` an uncached ``data`` is persisted for the call (so
        the upstream lineage runs once) and unpersisted after.

        Partition ``p`` goes to feeding node ``p % number of chief+worker nodes``;
        each feeding task returns only once its node has taken the whole
        partition.  Returns the number of records fed (after a restart, by the
        resumed feed).  If a node fails, raises :class:`EmberNodeError` with
        its traceback, or with ``max_restarts`` relaunches the nodes (main_fun
        resumes from its checkpoint) and feeds this call's data again from the
        epoch the restarted nodes name with ``ctx.resume_from(epoch)``: the
        smallest one any chief/worker names, epoch 0 when one reads its feed
        without naming any.  Earlier epochs are not fed again; that epoch and
        the later ones are fed whole.  Epochs are counted from 0 within this
        call, and each batch's epoch is ``feed.epoch`` on the node.

        Every call is one feed call (a 64-bit id, so a cluster takes any
        number of them); the node's feed marks where each partition and the
        call end.  ``qname`` names the node queue the data is for (read by
        ``ember.compat.tfos``'s queues); ``stream=True`` marks the call as
        one micro-batch of a stream: the nodes' feeds do not end at its end.
        """
        if self.input_mode != InputMode.SPARK:
            raise ValueError("train() feeds data only in InputMode.SPARK; in "
                             "InputMode.TENSORFLOW the nodes read their own input")
        if num_epochs <= 0:
            _log(f"num_epochs={num_epochs}: feeding the data once (TensorFlowOnSpark fed 10 passes; "
                 "ember.compat.tfos keeps that)")
        epochs = max(1, num_epochs)
        # k epochs are one Spark job over k copies of the data; the copies read
        # a cached dataset, so the upstream lineage runs once, not k times
        # (Spark's block manager makes a task wait for a partition another task
        # is caching rather than compute it twice).
        cached = epochs > 1 and not data.is_cached if _is_dataframe(data) else \
            epochs > 1 and not data.getStorageLevel().useMemory and \
            not data.getStorageLevel().useDisk
        from pyspark import StorageLevel

        per_epoch = data.rdd.getNumPartitions() if _is_dataframe(data) else \
            data.getNumPartitions()
        if epochs * per_epoch > _MAX_PARTITIONS:
            raise ValueError(f"ember feeds at most {_MAX_PARTITIONS} partitions per train() "
                             f"call; {epochs} epochs of {per_epoch} partitions are more")
        if cached:
            data = data.persist(StorageLevel.MEMORY_AND_DISK)
        first = 0  # the epoch the feed starts from: 0, or where a restart resumes
        interrupted = False  # a node failed while this call was feeding
        try:
            while True:
                failure = self._failure()
                if failure is None:
                    if first >= epochs:
                        _log(f"train: the nodes resume from epoch {first} of {epochs}: "
                             "nothing left to feed")
                        return 0
                    try:
                        return self._feed_once(self._epochs_of(data, epochs - first), epochs,
                                               feed_timeout, first, per_epoch, qname, stream)
                    except EmberNodeError as exc:
                        failure, interrupted = exc, True
                self._restart_or_raise(failure)
                if cached:
                    # The cancelled feed left the cached partitions wherever its
                    # tasks happened to run.  Spark runs a task where its
                    # partition is cached first, so that scatter can give every
                    # free slot partitions of one node, whose feeding tasks then
                    # wait for it to consume while it waits in its collectives
                    # for a peer nobody feeds (seen on the standalone cluster).
                    # Cache afresh: the tasks run as in a first feed.
                    data.unpersist(blocking=True)
                    data.persist(StorageLevel.MEMORY_AND_DISK)
                if interrupted:
                    first = self._resume_epoch(epochs, feed_timeout)
        finally:
            if cached:
                data.unpersist()

    def _epochs_of(self, data: Any, count: int) -> Any:
        """``count`` copies of ``data`` as one RDD/DataFrame, epoch-major: one Spark
        job feeds them all, reading a cached ``data``."""
        if _is_dataframe(data):
            source = data
            for _ in range(count - 1):
                source = source.unionAll(data)
            return source
        return self.sc.union([data] * count) if count > 1 else data

    def _resume_epoch(self, epochs: int, timeout: float) -> int:
        """After a restart in train(): the epoch to feed from.

        Waits until every chief/worker node has either named its epoch
        (``ctx.resume_from``) or started reading its feed without naming one
        (epoch 0), or has ended; returns the smallest epoch named, so no node
        misses data its checkpoint does not cover."""
        fed = [n["index"] for n in self.nodes if n["role"] in FEED_ROLES]
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._failures:
                waiting = [i for i in fed if i not in self._resume
                           and self._state.get(i) == "running"]
                if not waiting:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"ember train: after restart {self.restarts}, "
                        + ", ".join(self._name(i) for i in waiting)
                        + f" neither called ctx.resume_from() nor read the feed within "
                          f"{timeout:.0f} s (feed_timeout)")
                self._changed.wait(min(left, 0.5))
            named = [self._resume[i] for i in fed if i in self._resume]
        first = max(0, min(named)) if named else 0
        if first:
            _log(f"train: feeding from epoch {first} of {epochs} (ctx.resume_from); "
                 + ("epoch 0 is" if first == 1 else f"epochs 0..{first - 1} are")
                 + " not fed again")
        return first

    def _feed_once(self, source: Any, epochs: int, feed_timeout: float, first_epoch: int = 0,
                   per_epoch: int = 0, qname: str = "input", stream: bool = False) -> int:
        """Feeds ``source``, epochs ``first_epoch..epochs-1`` of ``per_epoch``
        partitions each: the call's partitions ``first..parts-1``, epoch-major."""
        seq = self._next_seq()
        targets = self._feed_targets()
        start = time.monotonic()
        count = source.rdd.getNumPartitions() if _is_dataframe(source) else \
            source.getNumPartitions()
        per_epoch = per_epoch or count
        first, parts = first_epoch * per_epoch, epochs * per_epoch
        nodes, report, sc = len(targets), self._report_channel(), self.sc
        # One feeding task per fed node (ember._grouping), so that no node is
        # left without a feeder whatever Spark's scheduler runs first.  Grouped
        # in the job's own thread: py4j finds Ember's class through the
        # calling thread, and a DataFrame's plan may run jobs as it is made.
        if _is_dataframe(source):
            tensors = tensor_specs(source.schema)

            def action() -> int:
                from ember import _grouping

                groups = _grouping_class(sc)
                data = source if groups is None else \
                    _grouping.group_dataframe(source, groups, nodes, first, count)
                fn = _arrow_feeder(targets, self._secret, seq, feed_timeout, self.chunk_bytes,
                                   parts, tensors, self._fault_feed_fail_at, report=report,
                                   first=first, per_epoch=per_epoch, grouped=groups is not None,
                                   qname=qname, stream=stream)
                return sum(r[0] for r in data.mapInArrow(fn, "fed long").collect())
        else:
            def action() -> int:
                from ember import _grouping

                groups = _grouping_class(sc)
                data, upstream = (source, None) if groups is None else \
                    _grouping.group_rdd(source, groups, nodes, first)
                fn = _feeder(targets, self._secret, seq, feed_timeout, self.chunk_rows,
                             want_results=False, parts=parts, report=report, first=first,
                             per_epoch=per_epoch, grouped=groups is not None, upstream=upstream,
                             qname=qname, stream=stream)
                return data.mapPartitions(fn).sum()
        _log(f"train: feeding {count} partitions ({epochs - first_epoch} epoch(s)"
             + (f": {first_epoch}..{epochs - 1}" if first_epoch else "")
             + f") to {len(targets)} node(s)")
        # Partition p feeds node p % n.  A node given no partition would wait for
        # data forever while its peers wait for it in their collectives: end its
        # feed now, so it stops and a synchronous loop stops with it.
        fed_nodes = {p % len(targets) for p in range(first, min(parts, first + len(targets)))}
        for i, (host, port, name) in enumerate(targets):
            if i in fed_nodes:
                continue
            _log(f"train: {name} gets no partition ({count} partitions for {len(targets)} "
                 "nodes); ending its feed (repartition the data to at least as many "
                 "partitions as nodes)")
            self._end_feed(host, port, name)
        _warn_few_slots(sc, len(fed_nodes))
        fed = self._run_job(f"train {seq}", action, seq)
        secs = time.monotonic() - start
        _log(f"train: fed {fed} records in {secs:.1f} s ({fed / max(secs, 1e-9):.0f} records/s)")
        return int(fed)

    def inference(self, data: Any, feed_timeout: float = 600.0, qname: str = "input") -> Any:
        """An RDD of one result per input record, in order within each partition.

        Lazy, like any RDD: records are fed when the result is computed.  The
        nodes' main_fun reads with ``get_data_feed(train_mode=False)`` and
        answers with ``batch_results``.
        """
        if self.input_mode != InputMode.SPARK:
            raise ValueError("inference() needs InputMode.SPARK")
        failure = self._failure()
        if failure is not None:
            raise failure
        fn = _feeder(self._feed_targets(), self._secret, self._next_seq(), feed_timeout,
                     self.chunk_rows, want_results=True, qname=qname)
        return _as_rdd(data).mapPartitions(fn)

    # -- shutdown ------------------------------------------------------------
    def shutdown(self, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed, waits for chief and workers to finish, stops the rest.

        Leaves no node process, port or shared-memory segment behind.  Raises
        the first node failure, if any (in InputMode.TENSORFLOW a failure
        before the end restarts the nodes when ``max_restarts`` allows).
        """
        if self._closed:
            return
        try:
            while True:
                try:
                    self._finish(grace_secs, timeout)
                    break
                except EmberNodeError as exc:
                    if self.input_mode == InputMode.SPARK:
                        self._stop_all()
                        raise
                    self._restart_or_raise(exc)
            self._stop_all()
        except BaseException as exc:
            self._track_end("FAILED", exc)
            raise
        if self._mlflow_end_on_shutdown:
            self._track_end("FINISHED")

    # -- MLflow (ember.mlflow) -------------------------------------------------
    @property
    def mlflow_run_id(self) -> Optional[str]:
        """The job's MLflow run id (None when ``MLFLOW_TRACKING_URI`` is not set)."""
        return self._mlflow.run_id if self._mlflow is not None else None

    def log_artifacts(self, local_dir: str, artifact_path: Optional[str] = "model") -> None:
        """Uploads a local directory of the driver (the exported model, say) into
        the job's MLflow run under ``artifact_path``; nothing without tracking."""
        if self._mlflow is not None:
            self._mlflow.log_artifacts(local_dir, artifact_path)

    def _track_end(self, status: str, error: Optional[BaseException] = None) -> None:
        """Ends the job's MLflow run; a failure is tagged (``ember.failure``)."""
        run = self._mlflow
        if run is None or run.ended:
            return
        if error is not None:
            tags = _mlflow.failure_tags("ember.failure", str(error) or type(error).__name__)
            if isinstance(error, EmberNodeError):
                tags["ember.failure.node"] = str(error.node)
            run.set_tags(tags)
        run.end(status)

    def _finish(self, grace_secs: float, timeout: float) -> None:
        try:
            if self.input_mode == InputMode.SPARK:
                for host, port, name in self._feed_targets():
                    self._end_feed(host, port, name)
            trainers = [n["index"] for n in self.nodes if n["role"] in FEED_ROLES]
            deadline = time.monotonic() + timeout
            with self._lock:
                while not self._failures and any(self._state.get(i) != "done" for i in trainers):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = [self._name(i) for i in trainers if self._state.get(i) != "done"]
                        raise TimeoutError(f"ember shutdown: still running after {timeout} s: "
                                           + ", ".join(missing))
                    self._changed.wait(min(left, 0.5))
            if grace_secs:
                time.sleep(grace_secs)
        except TimeoutError:
            self._stop_all()
            raise
        failure = self._failure()
        if failure is not None:
            raise failure

    def _end_feed(self, host: str, port: int, name: str) -> None:
        """Ends fed node ``name``'s feed (END_FEED); a node that has ended has
        nothing to end, and a failed one raises its EmberNodeError (:meth:`_on_node`)."""
        def end(client: Any) -> None:
            client.end_feed(10.0)

        try:
            self._on_node(host, port, 0xFFFFFFFF, end, 10.0, f"end of feed to {name}")
        except _ember.EmberError as exc:  # a node that is already gone has nothing to end
            _log(f"end of feed not delivered to {name}: {exc}")

    def _index_of(self, host: str, port: int) -> Optional[int]:
        """The index of the node whose feed is at ``host:port``."""
        for n in self.nodes:
            if n["host"] == host and n["ports"][1] == port:
                return int(n["index"])
        return None

    def _on_node(self, host: str, port: int, key: int, use: Callable[[Any], None],
                 timeout: float, what: str) -> None:
        """Connects to a node's feed at ``host:port`` as ``key`` and runs
        ``use(client)``, watching the cluster all the while.

        Every wait on one node must also watch the nodes' liveness: a node
        that died refuses connections until the timeout (10 minutes for a
        feed), and one that hangs never answers.  So the delivery runs in a
        helper thread, and this one raises the first node failure (its
        :class:`EmberNodeError`, with the node's traceback) within 0.1 s of
        the driver learning of it.  Connecting retries in attempts of 1 s
        and gives up once the node is no longer running.  When the delivery
        fails (a dropped connection), a failure the driver learns of within
        2 s is raised instead of the connection's error; otherwise that error
        (an ``EmberError``) is."""
        index = self._index_of(host, port)
        done, quit_ = threading.Event(), threading.Event()
        outcome: Dict[str, BaseException] = {}

        def deliver() -> None:
            try:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        client = _ember.FeedClient(
                            host, port, self._secret, key, timeout_s=max(
                                0.05, min(_CONNECT_ATTEMPT, deadline - time.monotonic())))
                        break
                    except _ember.EmberTimeout:
                        with self._lock:
                            ended = index is not None and \
                                self._state.get(index, "running") != "running"
                        if ended or quit_.is_set() or time.monotonic() >= deadline:
                            raise
                try:
                    use(client)
                finally:
                    client.close()
            except BaseException as exc:  # raised in the caller's thread
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=deliver, name=f"ember-{what}", daemon=True).start()
        try:
            while not done.wait(0.1):
                failure = self._failure()
                if failure is not None:
                    raise failure
        finally:
            quit_.set()
        error = outcome.get("error")
        if error is None:
            return
        if isinstance(error, _ember.EmberError) and not isinstance(error, _ember.EmberAborted):
            deadline = time.monotonic() + 2.0
            with self._lock:
                while not self._failures and time.monotonic() < deadline:
                    self._changed.wait(0.1)
            failure = self._failure()
            if failure is not None:
                raise failure from error
        raise error

    def _stop_all(self, wait: bool = True) -> None:
        """Stops every node, waits for local node processes to exit (unless not
        ``wait``), closes the server.

        Without waiting, every node is still gone within the STOP's 5 s grace:
        its own control thread kills its process group then (a frozen node's
        watchdog already did, see ember._watchdog)."""
        if self._closed:
            return
        with self._lock:
            for i in range(self._num_nodes):
                if self._state.get(i) not in ("done", "failed", "lost"):
                    self._state[i] = "stopping"
        self._server.stop(-1, 5000)
        if wait:
            self._wait_nodes_exit(15.0)
        self._closed = True
        self._server.close()
        if self._reports is not None:
            self._reports[0].close()
            self._reports = None
        self._monitor.join(5)
        self._launch_thread.join(10)

    def _wait_nodes_exit(self, timeout: float) -> None:
        """Waits for this host's node processes to be gone (others exit on STOP)."""
        local = {"127.0.0.1", "localhost", socket.gethostname()}
        try:
            local.add(socket.gethostbyname(socket.gethostname()))
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        # A lost node that still runs is frozen (a running one kills itself as
        # soon as its control connection drops): its watchdog kills it about
        # heartbeat_timeout after it froze, i.e. about when it was seen lost.
        # Wait for that only briefly, so a hung node never delays the error.
        with self._lock:
            lost = {f.node: f.seen_at for f in self._failures
                    if self._state.get(f.node) == "lost"}
        for n in self.nodes:
            if n["host"] not in local and not n["host"].startswith("127."):
                continue
            until = min(deadline, lost[n["index"]] + 2.0) if n["index"] in lost else deadline
            while time.monotonic() < until and _alive(n["pid"]):
                time.sleep(0.05)

    def _tensorboard_node(self) -> int:
        """The index of the node that serves TensorBoard: the chief, else worker 0.

        Roles go in index order (ps, chief, evaluator, workers), so this is known
        before anyone registers."""
        r = self._roles
        return r["num_ps"] + (0 if r["chief"] else (1 if r["evaluator"] else 0))

    def tensorboard_url(self) -> Optional[str]:
        """TensorBoard's URL (``http://host:port``) when started with tensorboard=True."""
        node = self.tensorboard_node()
        if node is None:
            return None
        return f"http://{node['host']}:{node['ports'][2]}"

    def tensorboard_node(self) -> Optional[Dict[str, Any]]:
        """The node (one of :attr:`nodes`) serving TensorBoard, None without it."""
        if not self._tensorboard or not self.nodes:
            return None
        return self.nodes[self._tensorboard_node()]

    def failure(self) -> Optional[EmberNodeError]:
        """The node failure that ends the job, if the driver knows of one (what
        ``train`` or ``shutdown`` would raise); None while all is well."""
        return self._failure()

    def node_states(self) -> Dict[int, str]:
        """Each node's state, by index, as the driver knows it: ``running``,
        ``done`` (its main_fun returned), ``failed``, ``lost`` or ``stopping``."""
        with self._lock:
            return {n["index"]: self._state.get(n["index"], "running") for n in self.nodes}


def _is_dataframe(data: Any) -> bool:
    return hasattr(data, "mapInArrow")


def _as_rdd(data: Any) -> Any:
    """An RDD from an RDD or a DataFrame (whose rows become Row records)."""
    return data.rdd if hasattr(data, "rdd") and not hasattr(data, "mapPartitions") else data


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone (ESRCH can come from the read itself)
        return False


# --------------------------------------------------------------------------- run

def run(sc: Any, main_fun: Callable[[Any, Any], Any], args: Any = None, num_executors: int = 1,
        num_ps: int = 0, tensorboard: bool = False, input_mode: InputMode = InputMode.SPARK,
        log_dir: Optional[str] = None, driver_ps_nodes: bool = False,
        master_node: Optional[str] = "chief", reservation_timeout: float = 600,
        eval_node: bool = False, heartbeat_timeout: float = 10.0, max_restarts: int = 0,
        env: Optional[Dict[str, str]] = None, gpus_per_node: int = 0) -> Cluster:
    """Starts ``main_fun(args, ctx)`` on ``num_executors`` nodes and returns the cluster.

    :param sc: the SparkContext.
    :param main_fun: the per-node function; ``ctx`` is an :class:`ember.node.NodeContext`.
    :param num_executors: number of nodes (one barrier task each).
    :param num_ps: how many of them are parameter servers (role ``ps``).
    :param tensorboard: start TensorBoard on the chief (worker 0 without a chief)
        over ``log_dir``; :meth:`Cluster.tensorboard_url` gives its address.
    :param log_dir: TensorBoard's log dir (default ``<working dir>/tensorboard``).
    :param driver_ps_nodes: run the ps nodes as processes on the driver host
        instead of in the barrier job (which then has ``num_executors - num_ps`` tasks).
    :param input_mode: :attr:`InputMode.SPARK` (fed by ``train``/``inference``) or
        :attr:`InputMode.TENSORFLOW` (nodes read their own files).
    :param master_node: ``"chief"`` to make one node the chief, or None for workers only.
    :param eval_node: make one node the ``evaluator`` (not in the cluster spec).
    :param reservation_timeout: seconds to wait for all nodes to register; the
        error names the missing ones.
    :param heartbeat_timeout: seconds of silence after which a node counts as
        lost; a node that has not run at all for that long (SIGSTOP) is also
        killed, with its process group, by its watchdog (``ember._watchdog``).
    :param max_restarts: how many times a node failure relaunches all nodes
        (main_fun should resume from its latest checkpoint; ``EMBER_RESTART`` in
        its environment counts the restarts) before the failure is raised.
        During ``train``, the nodes name the epoch they resume from with
        ``ctx.resume_from(epoch)`` and the feed resumes there (see ``train``).
    :param env: extra environment variables for the node processes.
    :param gpus_per_node: GPUs for each node launched on an executor (0: none
        asked).  The nodes' barrier stage gets a task ``ResourceProfile`` of that
        many GPUs (and ``spark.task.cpus`` CPUs), so Spark assigns each task its
        own GPU addresses; the node sees exactly those (``CUDA_VISIBLE_DEVICES``,
        ``ctx.gpus``, :attr:`Cluster.gpus`), and no two nodes share one.  Needs
        executors with GPUs (``spark.executor.resource.gpu.amount`` and a
        discovery script) on standalone, YARN or Kubernetes; raises ValueError
        at once, naming what to configure, in local mode or when the executors
        cannot hold every node at once.  Spark holds the GPU only while the
        barrier task launches the node: keep other GPU tasks off these executors
        while the cluster runs.

    With ``MLFLOW_TRACKING_URI`` set, the job is one MLflow run: these
    arguments and ``args`` as params, the nodes' ``ctx.log_metrics``, restarts
    and failures (see :mod:`ember.mlflow`).
    """
    if num_executors < 1:
        raise ValueError(f"num_executors must be >= 1, got {num_executors}")
    if num_ps + (1 if eval_node else 0) >= num_executors:
        raise ValueError(f"num_executors={num_executors} leaves no chief/worker after "
                         f"num_ps={num_ps} and eval_node={eval_node}")
    roles = dict(num_ps=num_ps, chief=master_node is not None, evaluator=eval_node)
    cluster = Cluster(sc, main_fun, args, num_executors, roles, InputMode(input_mode),
                      reservation_timeout, heartbeat_timeout, max_restarts, dict(env or {}),
                      driver_ps_nodes=driver_ps_nodes, tensorboard=tensorboard, log_dir=log_dir)
    if gpus_per_node:
        on_executors = num_executors - (num_ps if driver_ps_nodes else 0)
        cluster._profile = _gpu.node_profile(sc, on_executors, gpus_per_node)
    cluster._mlflow = _mlflow.JobRun.start(
        f"{sc.appName} ember {cluster.job_id}",
        dict(main_fun=f"{getattr(main_fun, '__module__', '?')}:"
                      f"{getattr(main_fun, '__qualname__', repr(main_fun))}",
             num_executors=num_executors, num_ps=num_ps, tensorboard=tensorboard,
             input_mode=InputMode(input_mode).name, log_dir=log_dir,
             driver_ps_nodes=driver_ps_nodes, master_node=master_node,
             reservation_timeout=reservation_timeout, eval_node=eval_node,
             heartbeat_timeout=heartbeat_timeout, max_restarts=max_restarts,
             gpus_per_node=gpus_per_node, **_mlflow.args_params(args)),
        {"ember.job_id": cluster.job_id, "ember.spark.master": sc.master,
         "ember.spark.app_id": sc.applicationId})
    if cluster._mlflow is not None:
        cluster._env.update(cluster._mlflow.node_env())
    try:
        cluster._start()
    except BaseException as exc:
        cluster._track_end("FAILED", exc)
        raise
    return cluster
