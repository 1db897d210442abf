"""Ember from a Spark Connect client: the cluster API on a ``SparkSession``
made with ``SparkSession.builder.remote(...)`` (or ``pyspark-client``).

This is the code of :func:`ember.spark.run` that runs in the client when it
is given a Connect session.  The client uses only DataFrame APIs, and nothing
on the executors connects back to it (it may sit outside the cluster):

- the nodes run in one barrier ``mapInArrow`` stage for the cluster's whole
  life (:mod:`ember._connect_stage`), holding their task slots (and GPUs,
  with ``gpus_per_node``), started in a thread of the client;
- ``train(df)`` and ``inference(df)`` are ``mapInArrow`` jobs over the input
  DataFrame whose tasks feed the nodes' C feed, as classic Spark's do;
- node failures, heartbeat verdicts and the nodes' final states come back as
  the node stage's result: a node failure raises :class:`EmberNodeError`
  naming the node in ``train``, ``inference``'s actions and ``shutdown``,
  and interrupts the feeding job (``SparkSession.interruptTag``).

The feeding jobs need task slots beside the nodes' (one per fed node, for
synchronous training).  Differences from classic Spark are in
docs/spark.md ("Ember over Spark Connect").
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from ember import _connect_stage, _ember, _gpu
from ember.errors import EmberJobError, EmberNodeError, spark_job_cause
from ember.tensors import tensor_specs

logger = logging.getLogger("ember.spark")

_FAILURE_GRACE = 10.0  # s a failed feeding job waits for the node stage to name a failure


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
                 parameter_servers: Any, feed_chief: bool, gpus_per_node: int) -> None:
        from ember.driver import FEED_ROLES

        self.spark = spark
        self.input_mode = input_mode
        self.job_id = uuid.uuid4().hex[:12]
        self.feed_roles = FEED_ROLES if feed_chief else ("worker",)
        self.chunk_bytes = 4 << 20
        self.nodes: List[Dict[str, Any]] = []  # the nodes' final states, after the stage ends
        self._roles, self._num_nodes = roles, num_nodes
        self._reservation_timeout = reservation_timeout
        self._seq = 0
        if encrypt is None:  # Spark's own RPC encryption asks for ours too
            encrypt = str(spark.conf.get("spark.network.crypto.enabled", "false")
                          ).strip().lower() == "true"
        self.encrypt = encrypt
        self._secret = _ember.random_secret()
        ps_first = roles["num_ps"]
        tb_node = ps_first + (0 if roles["chief"] else (1 if roles["evaluator"] else 0))
        boot = dict(secret=self._secret, encrypt=bool(encrypt), main_fun=main_fun, args=args,
                    input_mode=int(input_mode), reservation_timeout=float(reservation_timeout),
                    heartbeat_interval_ms=max(100, int(heartbeat_timeout * 1000 / 5)),
                    heartbeat_timeout=float(heartbeat_timeout),
                    env=dict(env, EMBER_RESTART="0"), working_dir=None,
                    job_id=self.job_id, index_offset=0, tensorboard=tensorboard,
                    parameter_servers=parameter_servers, tensorboard_node=tb_node,
                    log_dir=log_dir or "tensorboard")
        task = _connect_stage.node_stage(boot, num_nodes, roles, reservation_timeout,
                                         heartbeat_timeout, self.feed_roles)
        stage = spark.range(num_nodes).repartition(num_nodes)
        kwargs: Dict[str, Any] = {"barrier": True}
        if gpus_per_node:
            kwargs["profile"] = _gpu.task_profile(
                gpus_per_node, int(spark.conf.get("spark.task.cpus", "1")))
        self._stage_df = stage.mapInArrow(task, _connect_stage.STATE_SCHEMA, **kwargs)
        self._rows: Optional[List[Any]] = None
        self._stage_error: Optional[BaseException] = None
        self._stage_done = threading.Event()
        self._tag = f"ember-{self.job_id}-nodes"
        self._thread = threading.Thread(target=self._run_stage, name="ember-connect-nodes",
                                        daemon=True)
        self._closed = False
        # MLflow tracking (ember.mlflow) is classic Spark's only, for now: no run
        self._mlflow: Any = None
        self._mlflow_end_on_shutdown = True
        logger.info(f"job {self.job_id}: launching {num_nodes} node(s) in a barrier stage "
                    "over Spark Connect")
        self._thread.start()

    # -- the node stage -------------------------------------------------------
    def _run_stage(self) -> None:
        self.spark.addTag(self._tag)  # this thread's operations
        try:
            self._rows = self._stage_df.collect()
        except BaseException as exc:
            self._stage_error = exc
        finally:
            self._stage_done.set()

    def _failure(self) -> Optional[BaseException]:
        """The node stage's failure, once it has ended: a node's EmberNodeError,
        or the stage's own error (it could not start, an executor was lost)."""
        if not self._stage_done.is_set():
            return None
        if self._stage_error is not None:
            return EmberJobError(f"ember over Spark Connect: the nodes' barrier stage failed: "
                                 f"{_cause(self._stage_error)}")
        rows = self._rows or []
        self.nodes = [r.asDict() for r in rows]
        for r in rows:
            if r["state"] in ("failed", "lost"):
                return EmberNodeError(r["error"], int(r["index"]), r["state"])
        return None

    def _stage_failure_after(self, waited: float) -> Optional[BaseException]:
        deadline = time.monotonic() + waited
        while time.monotonic() < deadline and not self._stage_done.is_set():
            self._stage_done.wait(0.1)
        return self._failure()

    def _run_job(self, what: str, action: Callable[[], Any], ended_ok: bool = False) -> Any:
        """Runs a feeding action in a thread under a tag of its own; interrupts
        it when the node stage ends meanwhile, raising the node's error if one
        failed (else EmberJobError, or returning None where ``ended_ok``)."""
        tag = f"ember-{self.job_id}-{what.replace(' ', '-')}"
        out: Dict[str, Any] = {}

        def job() -> None:
            self.spark.addTag(tag)
            try:
                out["value"] = action()
            except BaseException as exc:
                out["error"] = exc

        t = threading.Thread(target=job, name=f"ember-{what}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            if t.is_alive() and self._stage_done.is_set():
                # the nodes have ended: nothing will take this job's data
                self.spark.interruptTag(tag)
                t.join(30)
                failure = self._failure()
                if failure is not None:
                    raise failure
                if ended_ok:
                    return None
                raise EmberJobError(f"{what}: the nodes ended before it was done (main_fun "
                                    "returned on every node)")
        if "error" in out:
            failure = self._stage_failure_after(_FAILURE_GRACE)
            if failure is not None:
                raise failure from out["error"]
            raise EmberJobError(f"{what}: {_cause(out['error'])}") from out["error"]
        return out["value"]

    def _fed_count(self) -> int:
        r = self._roles
        return (self._num_nodes - r["num_ps"] - (1 if r["evaluator"] else 0)
                - (0 if "chief" in self.feed_roles or not r["chief"] else 1))

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
        failure = self._failure()
        if failure is not None:
            raise failure
        epochs = max(1, num_epochs)
        fed = self._fed_count()
        self._seq += 1
        # the epochs are copies of one shuffle (Spark reuses its exchange):
        # the upstream plan runs once, as a classic train()'s cache makes it
        parts = data.repartition(fed)
        source = parts
        for _ in range(epochs - 1):
            source = source.unionAll(parts)
        fn = _connect_stage.feeder(self.job_id, self._secret, self._seq, feed_timeout, 0,
                                   epochs * fed, fed, qname, self.chunk_bytes,
                                   tensor_specs(data.schema), self._reservation_timeout)
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
        import pyarrow as pa  # noqa: F401  (the tasks build Arrow results)
        from pyspark.sql.types import _parse_datatype_string

        from ember.driver import InputMode

        if self.input_mode != InputMode.SPARK:
            raise ValueError("inference() needs InputMode.SPARK")
        failure = self._failure()
        if failure is not None:
            raise failure
        self._seq += 1
        schema = _arrow_schema(_parse_datatype_string(result_schema))
        fn = _connect_stage.inferrer(self.job_id, self._secret, self._seq, feed_timeout, qname,
                                     self.chunk_bytes, tensor_specs(data.schema),
                                     self._reservation_timeout, schema)
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
        """Ends the feed (InputMode.SPARK), waits for the node stage to end
        (the trainers done, the others stopped) and raises the first node
        failure, if any."""
        from ember.driver import InputMode

        if self._closed:
            return
        self._closed = True
        if self.input_mode == InputMode.SPARK and not self._stage_done.is_set():
            end = _connect_stage.end_feeds(self.job_id, self._secret, self._reservation_timeout)
            try:
                self._run_job("end of feed", lambda: self.spark.range(1).repartition(1)
                              .mapInArrow(end, "ended long").collect(), ended_ok=True)
            except EmberNodeError:
                raise
            except EmberJobError as exc:
                logger.warning(f"shutdown: ending the feed failed: {exc}")
        if not self._stage_done.wait(timeout):
            self.spark.interruptTag(self._tag)
            raise TimeoutError(f"ember shutdown: the nodes still ran after {timeout} s")
        if grace_secs:
            time.sleep(grace_secs)
        failure = self._failure()
        if failure is not None:
            raise failure
        logger.info("nodes ended: " + ", ".join(f"{n['role']}:{n['task_index']} {n['state']}"
                                                for n in self.nodes))


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
