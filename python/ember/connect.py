"""Ember from a Spark Connect client: the cluster API on a ``SparkSession``
made with ``SparkSession.builder.remote(...)`` (or ``pyspark-client``).

This is the code of :func:`ember.spark.run` that runs in the client when it
is given a Connect session.  The client uses only DataFrame APIs, and nothing
on the executors connects back to it (it may sit outside the cluster):

- the nodes start in one barrier ``mapInArrow`` stage
  (:mod:`ember._connect_stage`) whose task 0 also starts the cluster's
  coordinator (:mod:`ember._connect_coordinator`: the rendezvous and the
  nodes' watch, which a classic driver hosts) on its executor host; the
  stage returns the registered nodes once all registered, and its tasks
  their slots, as classic Spark's barrier tasks do;
- ``train(df)`` and ``inference(df)`` are ``mapInArrow`` jobs over the input
  DataFrame whose tasks feed the nodes' C feed, as classic Spark's do;
- what the client asks the coordinator (a failed feeding job's cause, the
  end of the job in ``shutdown``) goes through a one-task job whose task
  connects to it, authenticated with the job secret: a node failure is
  raised as :class:`EmberNodeError` naming the node.

Differences from classic Spark are in docs/spark.md ("Ember over Spark
Connect").
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from ember import _connect_stage, _ember, _gpu, _imports, _spark_compat, executor
from ember.errors import EmberJobError, EmberNodeError, spark_job_cause
from ember.executor import FeedCall
from ember.tensors import tensor_specs

logger = logging.getLogger("ember.spark")

_WATCH_INTERVAL = 3.0  # s between the questions to the coordinator while a feeding job runs

def is_connect(session: Any) -> bool:
    """True for a Spark Connect session (without importing pyspark's Connect
    client, which needs grpc)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def _no_run(*_args: Any) -> None:
    """What a job without an MLflow run does with its artifacts and end: nothing."""


class ConnectCluster:
    """A running Ember cluster over Spark Connect.  Made by :func:`ember.spark.run`."""

    def __init__(self, spark: Any, main_fun: Callable[[Any, Any], Any], args: Any,
                 num_nodes: int, roles: Dict[str, Any], input_mode: int,
                 reservation_timeout: float, heartbeat_timeout: float, env: Dict[str, str],
                 tensorboard: bool, log_dir: Optional[str], encrypt: Optional[bool],
                 parameter_servers: Any, feed_chief: bool, gpus_per_node: int,
                 max_restarts: int = 0) -> None:
        from ember.driver import FEED_ROLES

        self.spark = spark
        self.input_mode = input_mode
        self.job_id = uuid.uuid4().hex[:12]
        self.feed_roles = FEED_ROLES if feed_chief else ("worker",)
        self.chunk_bytes = 4 << 20
        self.nodes: List[Dict[str, Any]] = []  # the registered nodes, by index
        self.states: Dict[int, str] = {}  # their final states, after shutdown()
        self._roles, self._num_nodes = roles, num_nodes
        self._reservation_timeout = reservation_timeout
        self._seq = 0
        self._control_seq = 0
        self._heartbeat_timeout = heartbeat_timeout
        if encrypt is None:  # Spark's own RPC encryption asks for ours too
            encrypt = str(spark.conf.get("spark.network.crypto.enabled", "false")
                          ).strip().lower() == "true"
        self.encrypt = encrypt
        self._secret = _ember.random_secret()
        ps_first = roles["num_ps"]
        tb_node = ps_first + (0 if roles["chief"] else (1 if roles["evaluator"] else 0))
        self._boot = dict(
            secret=self._secret, encrypt=bool(encrypt), main_fun=main_fun, args=args,
            preload=_imports.frameworks_of(main_fun, args=args), input_mode=int(input_mode),
            reservation_timeout=float(reservation_timeout),
            heartbeat_interval_ms=max(100, int(heartbeat_timeout * 1000 / 5)),
            heartbeat_timeout=float(heartbeat_timeout), env=dict(env), working_dir=None,
            job_id=self.job_id, index_offset=0, tensorboard=tensorboard,
            parameter_servers=parameter_servers, tensorboard_node=tb_node,
            log_dir=log_dir or "tensorboard")
        self._stage_kwargs: Dict[str, Any] = {"barrier": True}
        if gpus_per_node:
            _spark_compat.require("gpus_per_node over Spark Connect (mapInArrow's profile)",
                                  _spark_compat.MAP_IN_ARROW_PROFILE)
            self._stage_kwargs["profile"] = _gpu.task_profile(
                gpus_per_node, int(spark.conf.get("spark.task.cpus", "1")))
        self._closed = False
        # MLflow tracking (ember.mlflow) is classic Spark's only, for now: no run
        self._mlflow: Any = None
        self._mlflow_end_on_shutdown = True
        self._failed: Optional[EmberNodeError] = None
        self._max_restarts = max_restarts
        self.restarts = 0
        self.restart_causes: List[EmberNodeError] = []  # the failures that caused restarts
        self._launch()

    def _launch(self) -> None:
        """Runs the nodes' barrier stage; returns once every node registered."""
        boot = dict(self._boot, env=dict(self._boot["env"], EMBER_RESTART=str(self.restarts)))
        task = _connect_stage.launcher(boot, self._num_nodes, self._roles,
                                       self._reservation_timeout, self._heartbeat_timeout,
                                       self.feed_roles)
        stage = self.spark.range(self._num_nodes).repartition(self._num_nodes)
        self._failed = None
        logger.info(f"job {self.job_id}: launching {self._num_nodes} node(s) in a barrier "
                    "stage over Spark Connect"
                    + (f" (restart {self.restarts})" if self.restarts else ""))
        try:
            rows = stage.mapInArrow(task, _connect_stage.NODE_SCHEMA,
                                    **self._stage_kwargs).collect()
        except Exception as exc:
            raise EmberJobError(f"ember over Spark Connect: launching the nodes failed: "
                                f"{_cause(exc)}") from exc
        self.nodes = [dict(r.asDict(), ports=json.loads(r["ports"]), executor_id=r["executor"])
                      for r in sorted(rows, key=lambda r: r["index"])]
        host, port = self.nodes[0]["coordinator"].rsplit(":", 1)
        self._coordinator = (host, int(port))
        self._targets = tuple((n["host"], int(n["feed_port"]), executor.node_name(n))
                              for n in self.nodes if n["role"] in self.feed_roles)
        logger.info("cluster ready: " + ", ".join(
            f"{n['role']}:{n['task_index']}@{n['host']}:{n['ports'][0]}" for n in self.nodes)
            + f"; coordinator at {host}:{port}")

    # -- the coordinator ----------------------------------------------------------
    def _ask(self, request: Dict[str, Any], timeout: float = 60.0) -> Dict[str, Any]:
        """The coordinator's answer to ``request``, through a one-task job."""
        self._control_seq += 1
        host, port = self._coordinator
        fn = _connect_stage.control(host, port, self._secret, bool(self.encrypt),
                                    (1 << 62) + self._control_seq, request, timeout)
        try:
            rows = self.spark.range(1).repartition(1).mapInArrow(fn, "reply string").collect()
        except Exception as exc:
            raise EmberJobError(f"ember over Spark Connect: the cluster's coordinator at "
                                f"{host}:{port} did not answer {request.get('op')!r}: "
                                f"{_cause(exc)}") from exc
        return dict(json.loads(rows[0]["reply"]))

    def _failure_in(self, reply: Dict[str, Any]) -> Optional[EmberNodeError]:
        failure = reply.get("failure")
        if failure and self._failed is None:
            self._failed = EmberNodeError(failure["message"], int(failure["node"]),
                                          failure["kind"])
        return self._failed

    def _explain(self, what: str, error: BaseException) -> BaseException:
        """A failed feeding job's error: the node failure that explains it
        (the coordinator is asked, after giving a lost node's heartbeats
        time to lapse), else an EmberJobError with Spark's cause."""
        # a task that lost its connection to a node (libember's error in its
        # traceback) may have lost it to a frozen node, seen lost only after
        # heartbeat_timeout
        lost_link = "ember._ember.Ember" in str(error) or "ember.errors.EmberError" in str(error)
        deadline = time.monotonic() + (self._heartbeat_timeout + 2 if lost_link else 2.0)
        while True:
            try:
                failure = self._failure_in(self._ask({"op": "state"}))
            except EmberJobError:
                failure = None
            if failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if failure is not None:
            return failure
        return EmberJobError(f"{what}: {_cause(error)}")

    def _restart_or_raise(self, failure: EmberNodeError) -> None:
        """After a node failure: relaunch every node (max_restarts), or raise.
        The failed cluster's coordinator has STOPped its other nodes already;
        it is told to go."""
        try:
            self._ask({"op": "stop"}, 30.0)
        except EmberJobError as exc:  # its host may be the one that failed
            logger.info(f"the failed cluster's coordinator did not answer: {exc}")
        if self.restarts >= self._max_restarts:
            self._closed = True
            raise failure
        self.restarts += 1
        self.restart_causes.append(failure)
        logger.warning(f"{failure.args[0].splitlines()[0]}; restarting the cluster "
                       f"({self.restarts} of max_restarts={self._max_restarts}); main_fun "
                       "resumes from its latest checkpoint")
        self._launch()

    def _resume_epoch(self, epochs: int, timeout: float) -> int:
        """After a restart in train(): the epoch to feed from, the smallest one
        any chief/worker names with ``ctx.resume_from``, 0 when none does."""
        reply = self._ask({"op": "resume", "timeout": timeout}, timeout + 60)
        failure = self._failure_in(reply)
        if failure is not None:
            raise failure
        if reply["waiting"]:
            raise TimeoutError(
                f"ember train: after restart {self.restarts}, "
                + ", ".join(executor.node_name(self.nodes[i]) for i in reply["waiting"])
                + f" neither called ctx.resume_from() nor read the feed within {timeout:.0f} s")
        first = max(0, min(reply["resume"])) if reply["resume"] else 0
        if first:
            logger.info(f"train: feeding from epoch {first} of {epochs} (ctx.resume_from)")
        return first

    def _run_job(self, what: str, action: Callable[[], Any]) -> Any:
        """Runs a Spark action; its failure raises the node failure that
        explains it, else :class:`EmberJobError` (:meth:`_explain`)."""
        if self._failed is not None:
            raise self._failed
        tag = f"ember-{self.job_id}-{self._seq}-{what.replace(' ', '-')}"
        out: Dict[str, Any] = {}

        def job() -> None:
            self.spark.addTag(tag)  # this thread's operations
            try:
                out["value"] = action()
            except Exception as exc:  # raised in the caller's thread
                out["error"] = exc

        t = threading.Thread(target=job, name=f"ember-{what}", daemon=True)
        t.start()
        # A task that connects to a node which died first would retry until
        # feed_timeout: while the job runs, ask the coordinator now and then,
        # and interrupt the job at a node failure.
        while True:
            t.join(_WATCH_INTERVAL)
            if not t.is_alive():
                break
            try:
                failure = self._failure_in(self._ask({"op": "state"}))
            except EmberJobError:
                continue  # the job's own error will tell
            if failure is not None:
                self.spark.interruptTag(tag)
                t.join(60)
                raise failure
        if "error" in out:
            raise self._explain(what, out["error"]) from out["error"]
        return out["value"]

    # -- feeding --------------------------------------------------------------
    def train(self, data: Any, num_epochs: int = 1, feed_timeout: float = 600.0,
              qname: str = "input") -> int:
        """Feeds every row of DataFrame ``data`` ``num_epochs`` times, as
        :meth:`ember.driver.Cluster.train` does; returns the rows fed.

        The data is repartitioned to one partition per fed node (one shuffle,
        whose output every epoch reads)."""
        from ember.driver import InputMode

        if self.input_mode != InputMode.SPARK:
            raise ValueError("train() feeds data only in InputMode.SPARK; in "
                             "InputMode.TENSORFLOW the nodes read their own input")
        epochs = max(1, num_epochs)
        first = 0  # the epoch the feed starts from: 0, or where a restart resumes
        while True:
            try:
                return self._feed(data, epochs, first, feed_timeout, qname)
            except EmberNodeError as exc:
                self._restart_or_raise(exc)
                first = self._resume_epoch(epochs, feed_timeout)
                if first >= epochs:
                    logger.info(f"train: the nodes resume from epoch {first} of {epochs}: "
                                "nothing left to feed")
                    return 0

    def _feed(self, data: Any, epochs: int, first: int, feed_timeout: float,
              qname: str) -> int:
        """Feeds epochs ``first..epochs-1`` of ``data`` as one feed call."""
        fed = len(self._targets)
        self._seq += 1
        from pyspark.sql import functions as F

        from ember._grouping import PARTITION_COLUMN

        # The epochs are copies of one shuffle (Spark reuses its exchange):
        # the upstream plan runs once, as a classic train()'s cache makes it.
        # Spark may zip a union of equally partitioned inputs (one task
        # reads partition i of every copy) or not, so each row carries its
        # feed partition, e * fed + its share (counted from the call's
        # first), and a task feeds the partitions its rows name.
        parts = data.repartition(fed)
        copies = [parts.withColumn(PARTITION_COLUMN,
                                   F.spark_partition_id() + F.lit((e - first) * fed))
                  for e in range(first, epochs)]
        source = copies[0]
        for copy in copies[1:]:
            source = source.unionAll(copy)
        call = FeedCall(self._targets, self._secret, self._seq, feed_timeout, first=first * fed,
                        parts=epochs * fed, per_epoch=fed, qname=qname, labelled=True,
                        encrypt=bool(self.encrypt), coordinator=self._coordinator)
        fn = executor.arrow_feeder(call, self.chunk_bytes, tensor_specs(data.schema))
        start = time.monotonic()
        total = self._run_job(f"train call {self._seq}", lambda: sum(
            r[0] for r in source.mapInArrow(fn, "fed long").collect()))
        secs = time.monotonic() - start
        logger.info(f"train: fed {total} records in {secs:.1f} s "
                    f"({total / max(secs, 1e-9):.0f} records/s)")
        return int(total)

    def inference(self, data: Any, result_schema: str = "result array<bigint>",
                  feed_timeout: float = 600.0, qname: str = "input") -> Any:
        """A DataFrame of the nodes' results, one row per input row, in order
        within each partition, of ``result_schema`` (the columns of the
        node's ``batch_results``, in order).  Lazy, like any DataFrame."""
        from pyspark.sql.types import _parse_datatype_string

        from ember.driver import InputMode

        if self.input_mode != InputMode.SPARK:
            raise ValueError("inference() needs InputMode.SPARK")
        if self._failed is not None:
            raise self._failed
        self._seq += 1
        schema = _arrow_schema(_parse_datatype_string(result_schema))
        call = FeedCall(self._targets, self._secret, self._seq, feed_timeout, want_results=True,
                        qname=qname, encrypt=bool(self.encrypt), coordinator=self._coordinator)
        fn = _connect_stage.inferrer(call, self.chunk_bytes, tensor_specs(data.schema), schema)
        return data.mapInArrow(fn, result_schema)

    def collect_inference(self, data: Any, result_schema: str = "result array<bigint>",
                          feed_timeout: float = 600.0) -> List[Any]:
        """``inference(data).collect()``, raising a node failure that explains
        a failed job as :meth:`train` does."""
        df = self.inference(data, result_schema, feed_timeout)
        return list(self._run_job(f"inference call {self._seq}", df.collect))

    #: the interface EmberEstimator.fit uses; no MLflow run over Connect
    log_artifacts = staticmethod(_no_run)
    _track_end = staticmethod(_no_run)

    # -- shutdown ---------------------------------------------------------------
    def shutdown(self, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed (InputMode.SPARK), waits for the chief and workers to
        finish, stops the others and raises the first node failure, if any:
        one request to the coordinator, which answers when that is done."""
        from ember.driver import InputMode

        if self._closed:
            return
        self._closed = True
        while True:
            reply = self._ask({"op": "finish", "end_feed": self.input_mode == InputMode.SPARK,
                               "timeout": timeout}, timeout + 60)
            self.states = {int(k): v for k, v in reply["states"].items()}
            failure = self._failure_in(reply)
            if failure is None:
                break
            if self.input_mode == InputMode.SPARK:
                self._closed = True
                raise failure
            # InputMode.TENSORFLOW: the nodes start again from their checkpoints
            self._closed = False
            self._restart_or_raise(failure)
            self._closed = True
        if grace_secs:
            time.sleep(grace_secs)
        running = [executor.node_name(self.nodes[i]) for i, v in self.states.items()
                   if v not in ("done", "stopping")]
        if running:
            raise TimeoutError(f"ember shutdown: still running after {timeout} s: "
                               + ", ".join(running))
        logger.info("nodes ended: " + ", ".join(
            f"{n['role']}:{n['task_index']} {self.states.get(n['index'])}" for n in self.nodes))


class _SessionConf:
    """A session's conf with SparkConf's ``get(key, default=None)`` (a Connect
    session's ``spark.conf.get`` raises for an unset key without a default)."""

    def __init__(self, session: Any) -> None:
        self._conf = session.conf

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        return self._conf.get(key, default)


def session_conf(session: Any) -> Any:
    """The Spark conf to read settings from: the SparkContext's (classic), or
    the session's (Spark Connect)."""
    return _SessionConf(session) if is_connect(session) else session.sparkContext.getConf()


def _cause(exc: BaseException) -> str:
    """What failed a Spark job, in a line (and the task's traceback)."""
    text = str(exc).strip()
    return spark_job_cause(text) or (text.splitlines()[0][:2000] if text
                                     else type(exc).__name__)


def _arrow_schema(struct: Any) -> Any:
    """The pyarrow schema of a Spark StructType (the types mapInArrow returns)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(struct)
