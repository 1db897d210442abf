"""The driver of an Ember job on Spark: :func:`run` and the :class:`Cluster` it returns.

This is the code of :mod:`ember.spark` that runs in the driver process: it
starts the C rendezvous server, launches the nodes through a barrier stage
(:func:`ember.executor.launcher`), watches them over the control channel,
and runs the feeding jobs whose tasks (:mod:`ember.executor`) push data into
the nodes.  Import the public names from :mod:`ember.spark`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ember import _ember, _gpu, _imports, _log, _routing, executor
from ember import mlflow as _mlflow
from ember._env import bind_host
from ember.errors import (EmberError, EmberFeedError, EmberJobError, EmberNodeError,
                          find_feed_error, from_core, spark_job_cause)
from ember.executor import FeedCall
from ember.node import CHECKPOINT_REPORT, RESUME_REPORT, SERVING_REPORT
from ember.tensors import tensor_specs

FEED_ROLES = ("chief", "worker")
_MAX_PARTITIONS = 1 << 32  # partitions of one feed call (the feed's u32 partition id)
_CONNECT_ATTEMPT = 1.0  # s: a driver's connect to a node, between looks at its liveness


class InputMode(enum.IntEnum):
    """How data reaches the trainers (TensorFlowOnSpark's InputMode)."""

    TENSORFLOW = 0  #: main_fun reads its own files (TFRecords, ...)
    SPARK = 1  #: cluster.train(rdd) pushes partitions into the nodes' feeds


#: How long the driver waits for the cause of a failure that only reports a
#: vanished peer (the lost node's control connection drops at about the same
#: moment, see Cluster._failure).
_CAUSE_GRACE = 3.0

#: How long the driver waits for a node's failure to explain a job Spark
#: aborted, before it raises Spark's cause (EmberJobError); a killed node's
#: control connection drops at once, so its failure is known well within it.
_JOB_CAUSE_GRACE = 1.5

#: Launches of the nodes again, within one start or restart, after Spark lost
#: an executor the launch's barrier stage had a task on
_RELAUNCHES = 2

#: The driver logs as the public module it implements (see ember._log).
logger = logging.getLogger("ember.spark")


def _driver_bind(conf: Any) -> str:
    """Where the driver's servers listen: Spark's own choice for the driver
    (``spark.driver.bindAddress``, else ``spark.driver.host``), so they are
    reachable exactly where Spark's driver is (see ember._env.bind_host)."""
    return bind_host(conf.get("spark.driver.bindAddress", None)
                     or conf.get("spark.driver.host", None) or "")


def _grouping_class(sc: Any) -> Any:
    """Ember's grouping class in the JVM (see ember._grouping), or None, said
    once per driver, when Ember's Spark jar is missing."""
    from ember import _grouping

    groups = _grouping.java_class(sc)
    if groups is None and not _warned.get("jar"):
        _warned["jar"] = True
        from ember import _jars

        logger.warning(f"Ember's Spark jar ({_jars.SPARK_JAR}) is missing: train() feeds "
                       "one Spark task per partition, and under a synchronous strategy a "
                       "node can starve while Spark runs two tasks of another node "
                       "(reinstall Ember)")
    return groups


_warned: Dict[str, bool] = {}


def _warn_few_slots(sc: Any, fed: int) -> None:
    """Warns when the cluster cannot run a feeding task for every fed node at once."""
    from ember import _grouping

    slots = _grouping.task_slots(sc)
    if slots is not None and slots < fed:
        logger.warning(f"train: the Spark cluster runs {slots} task(s) at once for {fed} fed "
                       "nodes; each node's feeding task holds its slot until the node has "
                       "taken all its data, so the nodes are fed one group at a time and a "
                       "synchronous job (an all-reduce every step) waits for the feed "
                       f"timeout: give the job at least {fed} task slots")


# --------------------------------------------------------------------------- cluster

class Cluster:
    """A running Ember cluster: one node per barrier task.  Made by :func:`run`."""

    def __init__(self, sc: Any, main_fun: Callable[[Any, Any], Any], args: Any,
                 num_nodes: int, roles: Dict[str, Any], input_mode: InputMode,
                 reservation_timeout: float, heartbeat_timeout: float, max_restarts: int,
                 env: Dict[str, str], driver_ps_nodes: bool = False,
                 tensorboard: bool = False, log_dir: Optional[str] = None,
                 encrypt: Optional[bool] = None, parameter_servers: Any = None,
                 feed_chief: bool = True) -> None:
        self.sc = sc
        #: the roles train()/inference() feed: chief and workers, or only the
        #: workers when the chief only coordinates (run(feed_chief=False))
        self.feed_roles = FEED_ROLES if feed_chief else ("worker",)
        #: how the ps nodes serve Ember's parameter server (ember.ps.ParameterServers),
        #: None: they run main_fun like every node (TensorFlow's own ps servers)
        self.parameter_servers = parameter_servers
        #: the data plane (feed and collectives over TCP) is encrypted with
        #: AES-256-GCM; None until started: then ``spark.network.crypto.enabled``
        self.encrypt = encrypt
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
        # tests only: (partition, rows): that feeding task (of a DataFrame, or
        # of an RDD with no Python function of its own) raises on its first
        # attempt after sending that many rows; (partition, rows,
        # dir): it writes its pid to dir/pid-<partition> and waits to be killed
        self._fault_feed_fail_at: Optional[Tuple[Any, ...]] = None
        # tests only: False feeds one Spark task per partition, as without
        # Ember's jar (where Spark runs each task is then up to its scheduler)
        self._group_feeds = True
        # (FeedServer, secret) on the driver where feeding tasks report input
        # the feed cannot carry (EmberFeedError); made by the first train()
        self._reports: Any = None
        self.chunk_bytes = 4 << 20  # bytes per feed batch from a DataFrame's Arrow batches
        self.restarts = 0
        self.restart_causes: List[EmberNodeError] = []  # the failures that caused restarts
        self._main_fun, self._args, self._num_nodes, self._roles = main_fun, args, num_nodes, roles
        # what the nodes' fork server imports for them (ember._forkserver)
        self._preload = _imports.frameworks_of(main_fun, args=args)
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
        # train_stream's streams, by checkpoint location (ember._stream)
        self._streams: Dict[str, Any] = {}
        # fed node -> the first stream micro-batch its latest checkpoint lacks
        # (ctx.checkpointed); kept across restarts, as the checkpoints are
        self._checkpoints: Dict[int, int] = {}
        self._server: Any = None
        self._closed = True

    # -- lifecycle -------------------------------------------------------------
    def _start(self, relaunch: int = 0) -> None:
        """Starts a rendezvous server, launches the nodes and waits for all of
        them; launches them again (``relaunch``: how many times so far) when
        the launch's barrier stage failed because Spark lost an executor
        meanwhile (a host that died a moment ago, whose executor Spark had
        not counted lost yet when it placed a node there)."""
        sc, n = self.sc, self._num_nodes
        conf = sc.getConf()  # a copy of the whole conf through py4j: once
        # where the driver's servers listen, and the host nodes connect to
        self._driver_bind_host = _driver_bind(conf)
        self._driver_host = conf.get("spark.driver.host", socket.gethostname())
        if self.encrypt is None:  # Spark's own RPC encryption asks for ours too
            self.encrypt = str(conf.get("spark.network.crypto.enabled", "false")
                               ).strip().lower() == "true"
        self._secret = _ember.random_secret()
        self._server = server = _ember.RendezvousServer(
            self._secret, n, heartbeat_timeout_ms=int(self._heartbeat_timeout * 1000),
            host=self._driver_bind_host, **self._roles)
        self._state: Dict[int, str] = {}  # node -> running|done|failed|lost|stopping
        self._serving: Set[int] = set()  # nodes serving until stopped (SERVING_REPORT)
        self._failures: List[EmberNodeError] = []
        # fed node -> the epoch (or stream micro-batch) its main_fun resumes
        # from (ctx.resume_from), None when it read its feed without naming
        # one (see _await_resume_reports)
        self._resume: Dict[int, Optional[int]] = {}
        self._launch_error: Optional[BaseException] = None
        self._closed = False
        self._monitor = threading.Thread(target=self._watch, args=(server,),
                                         name="ember-monitor", daemon=True)
        self._monitor.start()
        driver_host = self._driver_host
        boot = dict(driver_host=driver_host, driver_port=server.port, secret=self._secret,
                    encrypt=bool(self.encrypt),
                    main_fun=self._main_fun, args=self._args, input_mode=int(self.input_mode),
                    preload=self._preload,
                    reservation_timeout=float(self._reservation_timeout),
                    heartbeat_interval_ms=max(100, int(self._heartbeat_timeout * 1000 / 5)),
                    heartbeat_timeout=float(self._heartbeat_timeout),
                    env=dict(self._env, EMBER_RESTART=str(self.restarts)),
                    working_dir=os.getcwd(), job_id=self.job_id,
                    index_offset=self._driver_nodes, tensorboard=self._tensorboard,
                    parameter_servers=self.parameter_servers,
                    tensorboard_node=self._tensorboard_node(),
                    log_dir=self._log_dir or os.path.join(os.getcwd(), "tensorboard"))
        group = f"ember-{self.job_id}-launch-{self.restarts}" + (f".{relaunch}" if relaunch else "")
        on_executors = n - self._driver_nodes

        self.gpus = {}

        def launch() -> None:
            sc.setJobGroup(group, f"ember: launch {on_executors} nodes", interruptOnCancel=True)
            try:
                for i in range(self._driver_nodes):
                    # spawned, never forked: the driver's ps nodes serve Ember's
                    # parameter servers (no framework) or join TensorFlow's once,
                    # and a fork server would outlive the job in the user's session
                    executor.spawn_node(dict(boot, index=i, sys_path=list(sys.path), preload=(),
                                             executor_id="driver", advertise_host=driver_host),
                                        self._reservation_timeout)
                rdd = sc.parallelize(range(on_executors), on_executors)
                if self._profile is not None:  # gpus_per_node: GPUs for this stage's tasks
                    rdd = rdd.withResources(self._profile)
                placed = rdd.barrier().mapPartitions(
                    executor.launcher(boot, self._reservation_timeout)).collect()
                self.gpus = {index: gpus for index, _host, _pid, gpus in placed}
            except BaseException as exc:
                self._launch_error = exc

        logger.info(f"job {self.job_id}: launching {n} node(s), rendezvous at "
                    f"{driver_host}:{server.port}"
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
            lost = [line.strip() for line in str(self._launch_error).splitlines()
                    if "ExecutorLostFailure" in line]
            if relaunch < _RELAUNCHES and lost:
                logger.warning(f"job {self.job_id}: Spark lost an executor while the nodes "
                               f"were launched ({lost[0]}); launching them again")
                self._start(relaunch + 1)
                return
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
        logger.info("cluster ready: " + placement)
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
        logger.warning(f"{failure.args[0].splitlines()[0]}; restarting the cluster "
                       f"({self.restarts} of max_restarts={self._max_restarts}); main_fun "
                       "resumes from its latest checkpoint")
        self._stop_all()
        self._retire_unreachable_executors(failure)
        self._start()

    def _retire_unreachable_executors(self, failure: EmberNodeError) -> None:
        """After a node lost by silence whose executor does not answer either
        (its host is cut off): asks Spark to replace that host's executors and
        forget their blocks.  Spark counts them alive until
        spark.network.timeout (120 s) and would place relaunched nodes or
        feeding tasks there, to wait that long (a barrier stage placed there
        fails whole).  A node lost while its executor answers (frozen, killed)
        leaves the executors alone."""
        if failure.kind != "lost" or "no heartbeat for" not in str(failure):
            return
        node = next((n for n in self.nodes if n["index"] == failure.node), None)
        host, _, port = str(node.get("executor_id", "") if node else "").rpartition(":")
        if not host or not port.isdigit():
            return  # local mode's executor ("driver"), or a node on the driver
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return  # the executor answers: only the node is gone
        except OSError:
            pass
        try:
            address = socket.gethostbyname(host)
            jsc = self.sc._jsc.sc()
            summaries = jsc.statusStore().executorList(True)
            ids = []
            for i in range(summaries.size()):
                summary = summaries.apply(i)
                executor_host = summary.hostPort().rpartition(":")[0]
                if summary.id() != "driver" and _resolves_to(executor_host, address):
                    ids.append(summary.id())
            if ids:
                jsc.schedulerBackend().killExecutors(self.sc._jvm.PythonUtils.toSeq(ids),
                                                     False, False, True)
                # and forget their blocks now (ember.spark.LostExecutors says why)
                from ember import _grouping

                lost = _grouping.java_class(self.sc, "ember.spark.LostExecutors")
                for executor_id in ids if lost is not None else ():
                    lost.forgetBlocks(jsc, executor_id)
                logger.warning(f"host {host} does not answer: asked Spark to replace its "
                               f"executor(s) {', '.join(ids)}, rather than wait "
                               "spark.network.timeout for them")
        except Exception as exc:  # py4j: a scheduler backend that cannot kill executors
            logger.warning(f"host {host} does not answer, and Spark was not asked to replace "
                           f"its executors ({exc}): tasks placed there wait until Spark counts "
                           "them lost (spark.network.timeout)")

    # -- monitoring --------------------------------------------------------
    def _name(self, i: int) -> str:
        return executor.node_name(self.nodes[i]) if i < len(self.nodes) else f"node {i}"

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
                    self._resume[node] = int(text) if named else None
                    self._changed.notify_all()
                if named:
                    logger.info(f"{self._name(node)}: resumes from {text}")
            elif kind == "progress" and code == SERVING_REPORT:  # ctx.serve_until_stopped
                with self._lock:
                    self._serving.add(node)
                    self._changed.notify_all()
                logger.info(f"{self._name(node)}: serving until shutdown")
            elif kind == "progress" and code == CHECKPOINT_REPORT:  # see ember._stream
                if (text or "").isdigit():
                    with self._lock:
                        self._checkpoints[node] = int(text)
            elif kind == "progress":  # ctx.report_progress: the node's line, named
                logger.info(f"{self._name(node)}: {text}")
            elif kind == "rejected":
                logger.warning(text)  # a whole line, rate-limited for strangers (C server)
            elif kind in ("done", "failed", "lost"):
                with self._lock:
                    if kind == "done":
                        self._state[node] = "done"
                    elif self._state.get(node) != "stopping":
                        self._state[node] = kind
                        msg = executor.node_failure(self._name(node), kind, code, text,
                                                    self._heartbeat_timeout)
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
    def _cancel(self, group: str, t: threading.Thread, timeout: float = 60.0) -> None:
        """Cancels job group ``group`` until thread ``t``, which runs its jobs, ends.

        One cancel is not enough: an action may run several jobs in a row
        (grouping the data, then feeding it), and a cancel between two of
        them finds no active job while the next one starts after it."""
        deadline = time.monotonic() + timeout
        while t.is_alive() and time.monotonic() < deadline:
            self.sc.cancelJobGroup(group)
            t.join(0.5)

    def _run_job(self, what: str, action: Callable[[], Any], seq: Optional[int] = None,
                 cancel_when: Optional[Callable[[], bool]] = None) -> Any:
        """Runs a Spark action in a thread; cancels it if a node fails meanwhile,
        or once ``cancel_when()`` (asked every half second) is true, raising
        :class:`EmberJobError`.

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
        asked = time.monotonic()
        while t.is_alive():
            t.join(0.1)
            if cancel_when is not None and time.monotonic() - asked >= 0.5:
                asked = time.monotonic()
                if cancel_when():
                    self._cancel(group, t)
                    raise EmberJobError(f"{what}: cancelled, its stream was stopped")
            feed_error = self._reported_feed_error(seq)
            if feed_error is not None:  # the cause, also of a node that raised on it
                t.join(0.2)  # a job Spark does not retry is failing by itself
                self._cancel(group, t)
                raise feed_error from result.get("error")
            failure = self._failure()
            if failure is not None:
                self._cancel(group, t)
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
            error = result["error"]
            explained = self._explain_job_error(f"{what}: feeding", error)
            if explained is not None:
                raise explained from error
            raise error
        return result.get("value")

    def _explain_job_error(self, what: str, error: BaseException) -> Optional[EmberError]:
        """The Ember error to raise for a job of this cluster's that Spark
        aborted with ``error``: a node's failure that explains it, else an
        :class:`EmberJobError` whose first line is Spark's cause (prefixed by
        ``what``), else None (not a failure Spark reports in its usual words)."""
        text = str(error)
        # A task that lost its connection to a node (libember's error in its
        # traceback) failed because of the node, and a frozen or cut-off node
        # is seen lost only after heartbeat_timeout: wait for that.  Anything
        # else Spark aborted is raised at once, unless a node failure arrives
        # meanwhile.
        if not self._closed:
            grace = self._heartbeat_timeout + 2 if "ember._ember.Ember" in text \
                else _JOB_CAUSE_GRACE
            deadline = time.monotonic() + grace
            with self._lock:
                while not self._failures and time.monotonic() < deadline:
                    self._changed.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            failure = self._failure()
            if failure is not None:
                return failure
        cause = spark_job_cause(text)
        return EmberJobError(f"{what} {cause}") if cause is not None else None

    def _report_channel(self) -> Tuple[str, int, bytes]:
        """(driver host, port, secret) of the feed server where feeding tasks
        report an :class:`EmberFeedError` (:func:`ember.executor.report_feed_error`):
        Ember's own authenticated channel, so the driver hears of it within
        milliseconds, not when Spark gives up retrying."""
        if self._reports is None:
            secret = _ember.random_secret()
            # a report is one FEED_ERROR of at most 1 KiB: small limits
            # encrypted with the job: a report may quote the input it refuses
            self._reports = (_ember.FeedServer(secret, shm=False, queue_bytes=1 << 20,
                                               max_frame=1 << 16, host=self._driver_bind_host,
                                               encrypt=bool(self.encrypt)),
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

    def _fed_nodes(self) -> List[Dict[str, Any]]:
        return [n for n in self.nodes if n["role"] in self.feed_roles]

    def _feed_targets(self) -> List[executor.Target]:
        return [(n["host"], n["ports"][1], self._name(n["index"])) for n in self._fed_nodes()]

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
        layout, see docs/spark.md), each a numpy array with the row axis first.  With
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
        if _is_dataframe(data) and data.isStreaming:
            raise ValueError("train() got a streaming DataFrame: train on a stream with "
                             "cluster.train_stream(df, checkpoint_location=...), which feeds "
                             "each micro-batch exactly once for as long as the query runs")
        if num_epochs <= 0:
            logger.warning(f"train(num_epochs={num_epochs}): feeding the data once "
                           "(TensorFlowOnSpark fed 10 passes; ember.compat.tfos keeps that); "
                           "pass num_epochs >= 1")
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
                        logger.info(f"train: the nodes resume from epoch {first} of {epochs}: "
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
                    # Cache afresh: the tasks run as in a first feed.  Not
                    # blocking: Spark's master drops the blocks' locations at
                    # once and only the removal on each executor is
                    # asynchronous, and an executor cut off from the driver
                    # would hold a blocking call for spark.rpc.askTimeout
                    # (120 s) before the restarted nodes got any data.
                    data.unpersist(blocking=False)
                    data.persist(StorageLevel.MEMORY_AND_DISK)
                if interrupted:
                    first = self._resume_epoch(epochs, feed_timeout)
        finally:
            if cached:
                data.unpersist()

    def train_stream(self, data: Any, checkpoint_location: Optional[str] = None,
                     trigger: Optional[Dict[str, Any]] = None, feed_timeout: float = 600.0,
                     qname: str = "input", query_name: Optional[str] = None,
                     continuous: bool = False) -> Any:
        """Trains on a streaming DataFrame for as long as its query runs; returns
        the query (``pyspark.sql.streaming.StreamingQuery``).

        Each micro-batch reaches the chief and worker nodes as one round of
        their feed (``feed.micro_batches()`` on the node: see
        :meth:`ember.node.DataFeed.micro_batches`), every node a round for
        every micro-batch, in order.  Each micro-batch is written to the
        stream's feed log, then fed from it while the query logs the next; a
        micro-batch waits until the nodes have taken the one before (one in
        flight at most), so a trainer slower than the stream holds the query
        back and nothing is dropped or buffered without bound.  A node's
        failure fails the query with the node's error, or with
        ``max_restarts`` restarts the nodes and goes on.

        **Exactly once.** Every record of a replayable source (files, Kafka,
        rate: what Spark's own exactly-once needs) is trained exactly once
        across restarts of the query (from the same ``checkpoint_location``)
        and of the nodes, by a trainer that checkpoints between micro-batches
        recording ``feed.next_micro_batch`` and, when it starts, names it with
        ``ctx.resume_from``: micro-batches are fed again from there (from the
        stream's feed log under ``checkpoint_location``, which keeps each
        micro-batch until every fed node reports with ``ctx.checkpointed``
        that its checkpoint holds it).

        After ``query.stop()`` (or a failure), the restarted query first feeds
        what the running nodes have not taken whole, from the log, and they
        get only the records they lack; :meth:`shutdown` stops the query after
        its micro-batch, waits for the nodes to take everything logged, then
        ends the feed.  One stream at a time per cluster.

        :param checkpoint_location: the query's checkpoint directory (local or
            ``hdfs://``); default ``spark.sql.streaming.checkpointLocation``
            plus the query's name.
        :param trigger: keyword arguments of ``DataStreamWriter.trigger``
            (``{"processingTime": "5 seconds"}``, ``{"availableNow": True}``).
        :param continuous: TensorFlowOnSpark's reading (``ember.compat.tfos``):
            micro-batches follow each other in the node's feed with no rounds.
        """
        from ember._stream import LOG_DIR, FeedLog, StreamFeed

        if self.input_mode != InputMode.SPARK:
            raise ValueError("train_stream() feeds data only in InputMode.SPARK")
        if not _is_dataframe(data) or not data.isStreaming:
            raise ValueError("train_stream() needs a streaming DataFrame (spark.readStream...); "
                             "train on an RDD or a DataFrame with train()")
        spark = data.sparkSession
        location = checkpoint_location
        if not location:
            base = spark.conf.get("spark.sql.streaming.checkpointLocation", None)
            if base:
                location = f"{base.rstrip('/')}/{query_name or 'ember-train'}"
        if not location:
            raise ValueError(
                "train_stream() needs checkpoint_location (or "
                "spark.sql.streaming.checkpointLocation): where Spark keeps the query's "
                "progress and Ember the micro-batches the nodes' checkpoints do not hold "
                "yet; a query restarted from it trains every record exactly once")
        key = location.rstrip("/")
        running = [k for k, s in self._streams.items() if s.query is not None and s.query.isActive]
        if running:
            raise RuntimeError(f"ember train_stream: the stream of {running[0]} is still running "
                               "on this cluster; stop its query first (one stream at a time)")
        failure = self._failure()
        if failure is not None and self.restarts >= self._max_restarts:
            raise failure
        stream = self._streams.get(key)
        if stream is None:
            stream = StreamFeed(self, len(self._streams), FeedLog(spark, f"{key}/{LOG_DIR}"),
                                feed_timeout, qname, continuous)
            self._streams[key] = stream
        stream.feed_timeout, stream.qname, stream.continuous = feed_timeout, qname, continuous
        writer = data.writeStream.foreachBatch(stream).option("checkpointLocation", key)
        if query_name:
            writer = writer.queryName(query_name)
        if trigger:
            writer = writer.trigger(**trigger)
        stream.restart_query()
        stream.query = writer.start()
        logger.info(f"train_stream: query {stream.query.id} feeds the nodes (checkpoint {key})")
        return stream.query

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
        """After a restart in train(): the epoch to feed from, the smallest one
        any chief/worker names (:meth:`_await_resume_reports`), 0 when none does,
        so no node misses data its checkpoint does not cover."""
        named = self._await_resume_reports(timeout, "train")
        first = max(0, min(named)) if named else 0
        if first:
            logger.info(f"train: feeding from epoch {first} of {epochs} (ctx.resume_from); "
                        + ("epoch 0 is" if first == 1 else f"epochs 0..{first - 1} are")
                        + " not fed again")
        return first

    def _await_resume_reports(self, timeout: float, what: str) -> List[int]:
        """Waits until every chief/worker node has either named where it resumes
        from (``ctx.resume_from``) or started reading its feed without naming
        one, or has ended; returns the positions named."""
        fed = [n["index"] for n in self._fed_nodes()]
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
                        f"ember {what}: after "
                        + (f"restart {self.restarts}" if self.restarts else "the start")
                        + ", " + ", ".join(self._name(i) for i in waiting)
                        + f" neither called ctx.resume_from() nor read the feed within "
                          f"{timeout:.0f} s (feed_timeout)")
                self._changed.wait(min(left, 0.5))
            return [p for p in (self._resume.get(i) for i in fed) if p is not None]

    def _checkpointed_through(self) -> Optional[int]:
        """The first stream micro-batch some fed node's latest checkpoint lacks
        (``ctx.checkpointed``); None until every fed node has told one."""
        fed = [n["index"] for n in self._fed_nodes()]
        with self._lock:
            held = [self._checkpoints.get(i) for i in fed]
        return None if any(h is None for h in held) else min(h for h in held if h is not None)

    def _feed_once(self, source: Any, epochs: int, feed_timeout: float, first_epoch: int = 0,
                   per_epoch: int = 0, qname: str = "input", stream: bool = False,
                   seq: Optional[int] = None, micro_batch: Optional[int] = None,
                   cancel_when: Optional[Callable[[], bool]] = None) -> int:
        """Feeds ``source``, epochs ``first_epoch..epochs-1`` of ``per_epoch``
        partitions each: the call's partitions ``first..parts-1``, epoch-major.
        ``seq``: the call's id (default: the next of train()'s); ``micro_batch``:
        the stream micro-batch it is; ``cancel_when``: see :meth:`_run_job`."""
        seq = self._next_seq() if seq is None else seq
        targets = self._feed_targets()
        start = time.monotonic()
        count = source.rdd.getNumPartitions() if _is_dataframe(source) else \
            source.getNumPartitions()
        per_epoch = per_epoch or count
        first, parts = first_epoch * per_epoch, epochs * per_epoch
        nodes, sc = len(targets), self.sc
        call = FeedCall(tuple(targets), self._secret, seq, feed_timeout,
                        encrypt=bool(self.encrypt), first=first,
                        parts=parts, per_epoch=per_epoch, qname=qname, stream=stream,
                        report=self._report_channel(), micro_batch=micro_batch)
        # Each node gets the partitions held on its host where round-robin
        # would send them elsewhere (ember._routing), so that its feeding
        # task reads them where they are cached
        local_to = (per_epoch, [_routing.host_names(host) for host, _, _ in targets])
        # One feeding task per fed node (ember._grouping), so that no node is
        # left without a feeder whatever Spark's scheduler runs first.  Grouped
        # in the job's own thread: py4j finds Ember's class through the
        # calling thread, and a DataFrame's plan may run jobs as it is made.
        if _is_dataframe(source):
            tensors = tensor_specs(source.schema)

            def action() -> int:
                from ember import _grouping

                groups = _grouping_class(sc) if self._group_feeds else None
                data, routes = (source, None) if groups is None else \
                    _grouping.group_dataframe(source, groups, nodes, first, count, local_to)
                fn = executor.arrow_feeder(
                    dataclasses.replace(call, grouped=groups is not None, routes=routes),
                    self.chunk_bytes, tensors, self._fault_feed_fail_at)
                return sum(r[0] for r in data.mapInArrow(fn, "fed long").collect())
        else:
            def action() -> int:
                from ember import _grouping

                groups = _grouping_class(sc) if self._group_feeds else None
                data, upstream, routes = (source, None, None) if groups is None else \
                    _grouping.group_rdd(source, groups, nodes, first, local_to)
                fn = executor.rdd_feeder(
                    dataclasses.replace(call, grouped=groups is not None, routes=routes),
                    self.chunk_rows, upstream,
                    frames=getattr(data._jrdd_deserializer, "frames", False),
                    fail_at=self._fault_feed_fail_at)
                return data.mapPartitions(fn).sum()
        logger.info(f"train: feeding {count} partitions ({epochs - first_epoch} epoch(s)"
                    + (f": {first_epoch}..{epochs - 1}" if first_epoch else "")
                    + f") to {len(targets)} node(s)")
        # Partition p feeds node p % n (routes, chosen in the job, only ever
        # reorder an epoch among all nodes).  A node given no partition would
        # wait for data forever while its peers wait for it in their
        # collectives: end its feed now, so it stops and a synchronous loop
        # stops with it.
        fed_nodes = {p % len(targets) for p in range(first, min(parts, first + len(targets)))}
        for i, (host, port, name) in enumerate(targets):
            if i in fed_nodes:
                continue
            logger.warning(f"train: {name} gets no partition ({count} partitions for "
                           f"{len(targets)} nodes); ending its feed (repartition the data to "
                           "at least as many partitions as nodes)")
            self._end_feed(host, port, name)
        _warn_few_slots(sc, len(fed_nodes))
        what = f"train call {seq}" if micro_batch is None else f"micro-batch {micro_batch}"
        fed = self._run_job(what, action, seq, cancel_when)
        secs = time.monotonic() - start
        logger.info(f"train: fed {fed} records" + ("" if micro_batch is None else
                                                   f" of micro-batch {micro_batch}")
                    + f" in {secs:.1f} s "
                    f"({fed / max(secs, 1e-9):.0f} records/s)")
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
        seq = self._next_seq()
        call = FeedCall(tuple(self._feed_targets()), self._secret, seq,
                        feed_timeout, want_results=True, qname=qname,
                        encrypt=bool(self.encrypt))
        fn = executor.rdd_feeder(call, self.chunk_rows)
        return _inference_rdd(_as_rdd(data), lambda _index, it: fn(it), self,
                              f"inference call {seq}:")

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
            for stream in self._streams.values():
                stream.stop()  # after the micro-batch being fed, if any
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
                # a trainer that serves (ctx.serve_until_stopped) ends when stopped
                while not self._failures and any(self._state.get(i) != "done"
                                                 and i not in self._serving for i in trainers):
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
        except _ember.EmberError as exc:
            if not from_core(exc):
                raise  # the node's failure (EmberNodeError)
            # a node that is already gone has nothing to end
            logger.info(f"end of feed not delivered to {name}: {exc}")

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
                            host, port, self._secret, key, encrypt=bool(self.encrypt),
                            timeout_s=max(
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
        if from_core(error) and not isinstance(error, _ember.EmberAborted):
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


_INFERENCE_RDD: Any = None


def _inference_rdd(prev: Any, f: Callable[[int, Any], Any], cluster: Cluster, what: str,
                   preserves_partitioning: bool = False) -> Any:
    """``prev.mapPartitionsWithIndex(f)`` as an RDD whose failed jobs raise
    Ember's errors: a node failure that explains the failure, else
    :class:`EmberJobError` with Spark's cause first (see
    :meth:`Cluster._explain_job_error`).  Narrow transformations of it (map,
    filter, mapPartitions, ...) keep that, so do the actions built on collect,
    take or save*File; Spark's own error comes out of anything else (a
    DataFrame made from it, a shuffle)."""
    global _INFERENCE_RDD
    if _INFERENCE_RDD is None:
        from pyspark.rdd import PipelinedRDD

        def explaining(action: Callable[..., Any]) -> Callable[..., Any]:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return action(self, *args, **kwargs)
                except Exception as exc:  # Py4JJavaError; ours (from an inner action) pass
                    if isinstance(exc, EmberError):
                        raise
                    explained = self._ember_cluster._explain_job_error(self._ember_what, exc)
                    if explained is None:
                        raise
                    raise explained from exc
            run.__name__, run.__doc__ = action.__name__, action.__doc__
            return run

        class InferenceRDD(PipelinedRDD):
            _ember_cluster: Cluster
            _ember_what: str

            def mapPartitionsWithIndex(self, f: Any, preservesPartitioning: bool = False) -> Any:
                return _inference_rdd(self, f, self._ember_cluster, self._ember_what,
                                      preservesPartitioning)

            collect = explaining(PipelinedRDD.collect)
            take = explaining(PipelinedRDD.take)
            saveAsTextFile = explaining(PipelinedRDD.saveAsTextFile)
            saveAsPickleFile = explaining(PipelinedRDD.saveAsPickleFile)

        _INFERENCE_RDD = InferenceRDD
    rdd = _INFERENCE_RDD(prev, f, preserves_partitioning)
    rdd._ember_cluster, rdd._ember_what = cluster, what
    return rdd


def _resolves_to(host: str, address: str) -> bool:
    try:
        return socket.gethostbyname(host) == address
    except OSError:
        return False


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
        env: Optional[Dict[str, str]] = None, gpus_per_node: int = 0,
        encrypt: Optional[bool] = None, parameter_servers: Any = None,
        feed_chief: bool = True) -> Cluster:
    """Starts ``main_fun(args, ctx)`` on ``num_executors`` nodes and returns the cluster.

    :param sc: the SparkContext, or a SparkSession: a classic one, or a Spark
        Connect client's (:mod:`ember.connect`: the cluster is then a
        :class:`ember.connect.ConnectCluster`).
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
    :param encrypt: encrypt and authenticate the data plane between hosts: the
        feed's and the collectives' TCP connections carry AES-256-GCM records,
        keyed per job and per connection (a changed, dropped, replayed or
        truncated record is refused, naming the peer).  Shared memory within a
        host stays in clear; the rendezvous/control channel stays authenticated
        (HMAC) as always.  None (default): on when the Spark conf has
        ``spark.network.crypto.enabled=true``.  Costs throughput: see
        docs/architecture.md ("secure").
    :param parameter_servers: an :class:`ember.ps.ParameterServers`: the
        ``num_ps`` ps nodes serve Ember's parameter server (asynchronous or
        bounded-staleness training; ``ctx.parameter_servers()`` on the chief
        and workers) instead of running ``main_fun``, and end when every
        worker finished.  None (default): ps nodes run ``main_fun`` like the
        others (e.g. TensorFlow's ``tf.distribute.Server`` for
        ParameterServerStrategy).  The data plane's ``encrypt`` applies.
    :param feed_chief: False: ``train()`` and ``inference()`` feed the workers
        only, for a chief that coordinates and reads no data (TensorFlow's
        ParameterServerStrategy, whose workers read their feed in a
        ``dataset_fn`` with :func:`ember.tf.feed_dataset`).

    With ``MLFLOW_TRACKING_URI`` set, the job is one MLflow run: these
    arguments and ``args`` as params, the nodes' ``ctx.log_metrics``, restarts
    and failures (see :mod:`ember.mlflow`).

    Progress is logged to the ``ember.spark`` logger (the nodes' reports, as
    ``node <i> (<role>:<task>, executor <id>, host <host>): <text>``); when
    the application configured no logging, Ember logs to stderr at INFO
    (see :mod:`ember._log`).
    """
    _log.default_handler()
    if num_executors < 1:
        raise ValueError(f"num_executors must be >= 1, got {num_executors}")
    if num_ps + (1 if eval_node else 0) >= num_executors:
        raise ValueError(f"num_executors={num_executors} leaves no chief/worker after "
                         f"num_ps={num_ps} and eval_node={eval_node}")
    if parameter_servers is not None and num_ps < 1:
        raise ValueError("parameter_servers needs ps nodes to serve them: pass num_ps >= 1")
    roles = dict(num_ps=num_ps, chief=master_node is not None, evaluator=eval_node)
    from ember import connect

    if connect.is_connect(sc):
        if driver_ps_nodes:
            raise ValueError("driver_ps_nodes: a Spark Connect client has no driver host to "
                             "run ps nodes on; run them in the barrier stage (the default)")
        return connect.ConnectCluster(  # type: ignore[return-value]
            sc, main_fun, args, num_executors, roles, InputMode(input_mode),
            reservation_timeout, heartbeat_timeout, dict(env or {}), tensorboard, log_dir,
            encrypt, parameter_servers, feed_chief, gpus_per_node, max_restarts)
    if hasattr(sc, "sparkContext"):  # a classic SparkSession
        sc = sc.sparkContext
    cluster = Cluster(sc, main_fun, args, num_executors, roles, InputMode(input_mode),
                      reservation_timeout, heartbeat_timeout, max_restarts, dict(env or {}),
                      driver_ps_nodes=driver_ps_nodes, tensorboard=tensorboard, log_dir=log_dir,
                      encrypt=encrypt, parameter_servers=parameter_servers,
                      feed_chief=feed_chief)
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
             gpus_per_node=gpus_per_node, encrypt=encrypt,
             parameter_servers=repr(parameter_servers), **_mlflow.args_params(args)),
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
