"""TensorFlowOnSpark's ``TFCluster`` on Ember: ``run`` returns a :class:`TFCluster`.

The 5-line version (a TFoS program with its import changed)::

    from ember.compat.tfos import TFCluster
    cluster = TFCluster.run(sc, main_fun, args, num_executors=2, num_ps=0,
                            input_mode=TFCluster.InputMode.SPARK, master_node='chief')
    cluster.train(rdd, num_epochs=3)
    cluster.shutdown()

Arguments and defaults are TFoS 2.2.x's; see docs/moving-from-tensorflowonspark.md
for every difference in behaviour.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Callable, Dict, List, Optional

from ember import _log
from ember.compat.tfos import _node
from ember.spark import EmberNodeError, InputMode, run as _ember_run

logger = logging.getLogger("ember.compat.tfos")

__all__ = ["InputMode", "TFCluster", "run", "EmberNodeError"]

#: TFoS's num_epochs=0: "pick an arbitrarily large number" -- it fed the data 10 times.
TFOS_DEFAULT_EPOCHS = 10


def _default_fs(sc: Any) -> str:
    """Spark's fs.defaultFS, ``file:///`` trimmed to ``file://`` (as TFoS)."""
    try:
        fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # no JVM gateway (tests with a fake context)
        fs = "file://"
    if fs.startswith("file://") and len(fs) > 7 and fs.endswith("/"):
        fs = fs[:-1]
    return fs


def _node_env(sc: Any) -> Dict[str, str]:
    """The nodes' extra environment: ``TF_USE_LEGACY_KERAS=1`` where ``tf_keras``
    is installed, since TFoS's programs are TF 2 Keras programs that Keras 3
    rejects (MultiWorkerMirroredStrategy, SavedModel exports...).  A choice of
    the user's wins: ``spark.executorEnv.TF_USE_LEGACY_KERAS`` (the nodes
    inherit their executor's environment) or ``TF_USE_LEGACY_KERAS`` in the
    driver's environment (passed on to the nodes as it is)."""
    import importlib.util

    try:
        executor_env = sc.getConf().get("spark.executorEnv.TF_USE_LEGACY_KERAS", None)
    except Exception:  # no JVM gateway (tests with a fake context)
        executor_env = None
    if executor_env is not None:
        return {}
    if "TF_USE_LEGACY_KERAS" in os.environ:
        return {"TF_USE_LEGACY_KERAS": os.environ["TF_USE_LEGACY_KERAS"]}
    try:
        installed = importlib.util.find_spec("tf_keras") is not None
    except (ImportError, ValueError):
        installed = False
    return {"TF_USE_LEGACY_KERAS": "1"} if installed else {}


def _why_not_registered(sc: Any, num_executors: int) -> str:
    """The likely reasons nodes could not start, from the Spark configuration."""
    conf = sc.getConf()
    reasons = []
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        reasons.append("spark.dynamicAllocation.enabled is true: executors come and go, "
                       "disable it (Ember needs num_executors slots at once)")
    try:
        slots = int(sc.defaultParallelism)
        master = sc.master or ""
        if not master.startswith("local"):
            executors = sc._jsc.sc().getExecutorMemoryStatus().size() - 1
            cores = int(conf.get("spark.executor.cores", "1"))
            task_cpus = int(conf.get("spark.task.cpus", "1"))
            slots = executors * max(1, cores // max(1, task_cpus))
            reasons.append(f"{executors} executor(s) registered with Spark, "
                           f"{cores} core(s) each, spark.task.cpus={task_cpus}")
        if slots < num_executors:
            reasons.append(f"only {slots} task slot(s) for {num_executors} nodes: raise "
                           "--num-executors / spark.cores.max, or lower num_executors")
    except Exception as exc:  # diagnostics are best effort
        reasons.append(f"(could not inspect the executors: {exc})")
    return "; ".join(reasons) if reasons else "all slots looked available; see the executors' logs"


class TFCluster:
    """A running cluster (TFoS's ``TFCluster``), made by :func:`run`."""

    sc: Any = None  #: SparkContext
    defaultFS: Optional[str] = None  #: e.g. ``file://`` or ``hdfs://<namenode>:8020``
    working_dir: Optional[str] = None  #: the driver's working directory
    num_executors: Optional[int] = None
    nodeRDD: Any = None  #: TFoS's node RDD; None (Ember launches nodes itself)
    cluster_id: Optional[int] = None
    cluster_info: Optional[List[Dict[str, Any]]] = None  #: one dict per node
    cluster_meta: Optional[Dict[str, Any]] = None
    input_mode: Any = None
    queues: Optional[List[str]] = None
    server: Any = None  #: the underlying :class:`ember.spark.Cluster`
    #: the query of a streaming DataFrame given to :meth:`train` (Ember's addition)
    stream_query: Any = None

    # -- feeding -------------------------------------------------------------
    def train(self, dataRDD: Any, num_epochs: int = 0, feed_timeout: float = 600,
              qname: str = "input") -> Optional[int]:
        """*InputMode.SPARK only*: feeds ``dataRDD`` (an RDD, a DataFrame, a DStream
        or a streaming DataFrame) to the master/chief and worker nodes
        ``num_epochs`` times (a stream: each record once, as it comes).

        ``num_epochs=0`` keeps TFoS's meaning, 10 passes over the data (logged).
        ``qname`` names the node queue that receives the data: with
        ``queues=['input', 'eval', ...]`` in :func:`run`, a node reads a second
        feed (e.g. validation data) with ``ctx.get_data_feed(qname_in='eval')``.
        Returns the number of records fed (None for a stream).

        A streaming DataFrame runs as ``Cluster.train_stream`` with the node's
        feed read as TFoS read a DStream's (one feed across micro-batches); its
        query is :attr:`stream_query`, and its checkpoint goes under
        ``spark.sql.streaming.checkpointLocation`` when set (a restarted query
        then goes on where it stopped), else in a temporary directory.
        """
        if self.input_mode != InputMode.SPARK:
            raise AssertionError("TFCluster.train() requires InputMode.SPARK")
        if qname not in (self.queues or []):
            raise AssertionError(f"Unknown queue: {qname}")
        if num_epochs < 0:
            raise AssertionError("num_epochs cannot be negative")
        if _is_dstream(dataRDD):
            cluster = self

            def feed_micro_batch(rdd: Any) -> None:
                cluster.server.train(rdd, 1, feed_timeout, qname, stream=True)

            dataRDD.foreachRDD(feed_micro_batch)
            return None
        if getattr(dataRDD, "isStreaming", False):
            location = None
            if not dataRDD.sparkSession.conf.get("spark.sql.streaming.checkpointLocation",
                                                 None):
                import tempfile

                location = tempfile.mkdtemp(prefix="ember-tfos-stream-")
                logger.info(f"train(streaming DataFrame): its checkpoint is {location} "
                            "(set spark.sql.streaming.checkpointLocation to restart the "
                            "query where it stopped)")
            self.stream_query = self.server.train_stream(
                dataRDD, checkpoint_location=location, feed_timeout=feed_timeout,
                qname=qname, query_name=f"tfos-{qname}", continuous=True)
            return None
        if num_epochs == 0:
            logger.info(f"train(num_epochs=0): feeding the data {TFOS_DEFAULT_EPOCHS} times "
                        "(TensorFlowOnSpark's meaning of 0); pass num_epochs to choose")
            num_epochs = TFOS_DEFAULT_EPOCHS
        return self.server.train(dataRDD, num_epochs, feed_timeout, qname)

    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input") -> Any:
        """*InputMode.SPARK only*: an RDD of the results the nodes give with
        ``DataFeed.batch_results``, one per input record, in order within each
        partition.  Lazy, like TFoS's: records are fed when it is computed."""
        if self.input_mode != InputMode.SPARK:
            raise AssertionError("TFCluster.inference() requires InputMode.SPARK")
        if qname not in (self.queues or []):
            raise AssertionError(f"Unknown queue: {qname}")
        return self.server.inference(dataRDD, feed_timeout, qname)

    # -- shutdown ------------------------------------------------------------
    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Waits for the master/chief and workers to finish, then stops every node.

        With ``ssc`` (Spark Streaming) it first waits until the StreamingContext
        terminates or every trainer has finished, then stops the stream
        gracefully.  ``grace_secs`` is waited after the trainers finish;
        ``timeout`` (seconds, -1 for none) raises ``TimeoutError`` -- no
        SIGALRM, no ``sys.exit``: node failures are raised as
        :class:`ember.spark.EmberNodeError` with the node's traceback.
        """
        core = self.server
        if ssc is not None:
            deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
            while not ssc.awaitTerminationOrTimeout(1):
                if core.failure() is not None or self._trainers_done():
                    logger.info("trainers finished; stopping the StreamingContext")
                    ssc.stop(stopSparkContext=False, stopGraceFully=True)
                    break
                if time.monotonic() > deadline:
                    ssc.stop(stopSparkContext=False, stopGraceFully=False)
                    break
        query = self.stream_query
        if query is not None:  # as with ssc: until the query ends or the trainers do
            deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
            while query.isActive and not query.awaitTermination(1):
                if core.failure() is not None or self._trainers_done() or \
                        time.monotonic() > deadline:
                    logger.info("stopping the streaming query")
                    break
        core.shutdown(grace_secs=grace_secs, timeout=timeout if timeout > 0 else float("inf"))

    def _trainers_done(self) -> bool:
        core = self.server
        states = core.node_states()
        return all(states[n["index"]] == "done" for n in core.nodes
                   if n["role"] in ("chief", "worker"))

    def tensorboard_url(self) -> Optional[str]:
        """TensorBoard's URL when started with ``tensorboard=True``, else None."""
        return self.server.tensorboard_url()


def _is_dstream(data: Any) -> bool:
    try:
        from pyspark.streaming import DStream
    except ImportError:
        return False
    return isinstance(data, DStream)


def run(sc: Any, map_fun: Callable[[Any, Any], Any], tf_args: Any, num_executors: int,
        num_ps: int, tensorboard: bool = False, input_mode: int = InputMode.TENSORFLOW,
        log_dir: Optional[str] = None, driver_ps_nodes: bool = False,
        master_node: Optional[str] = None, reservation_timeout: float = 600,
        queues: List[str] = ["input", "output", "error"], eval_node: bool = False,  # noqa: B006
        release_port: bool = True, encrypt: Optional[bool] = None) -> TFCluster:
    """Starts ``map_fun(tf_args, ctx)`` on ``num_executors`` nodes (TFoS's ``TFCluster.run``).

    :param num_ps: how many nodes are parameter servers (``ps``).
    :param master_node: the name of the chief role (``'chief'`` or ``'master'``), or
        None for workers only.  TF_CONFIG is exported only when there is one.
    :param eval_node: one node is the ``evaluator`` (InputMode.TENSORFLOW only).
    :param driver_ps_nodes: ps nodes run on the driver host (InputMode.TENSORFLOW only).
    :param tensorboard: TensorBoard on the chief (worker 0 without one) over ``log_dir``.
    :param reservation_timeout: seconds for every node to register; the error names
        the nodes that did not and the likely reason.
    :param queues: the node queues ``train``/``inference`` may name (``qname``).
    :param release_port: accepted; Ember holds the TF port so that gRPC can bind it
        at any time, and ``ctx.release_port()`` drops the hold.
    :param encrypt: Ember's addition: encrypt the feed and the collectives between
        hosts (see :func:`ember.spark.run`); None: per ``spark.network.crypto.enabled``.

    Roles go in TFoS's order: ps, then master/chief, then evaluator, then workers.
    Progress is logged to the ``ember.compat.tfos`` and ``ember.spark`` loggers
    (see :func:`ember.spark.run`).
    """
    _log.default_handler()
    if driver_ps_nodes and input_mode != InputMode.TENSORFLOW:
        raise Exception("running PS nodes on driver locally is only supported in "
                        "InputMode.TENSORFLOW")
    if eval_node and input_mode != InputMode.TENSORFLOW:
        raise Exception("running evaluator nodes is only supported in InputMode.TENSORFLOW")
    if master_node is not None and not isinstance(master_node, str):
        raise TypeError(f"master_node must be a role name such as 'chief' or 'master', "
                        f"got {master_node!r}")
    num_master = 1 if master_node else 0
    num_eval = 1 if eval_node else 0
    num_workers = max(num_executors - num_ps - num_eval - num_master, 0)
    total = num_ps + num_master + num_eval + num_workers
    if total != num_executors:
        raise AssertionError(f"TensorFlow cluster requires {total} nodes, but only "
                             f"{num_executors} executors available")
    if num_master + num_workers <= 0:
        raise AssertionError("TensorFlow cluster requires at least one worker or master/chief node")
    queues = list(queues)
    if "input" not in queues:
        raise ValueError(f"queues must include 'input', got {queues}")

    template: Dict[str, List[int]] = {}
    executors = list(range(num_executors))
    for role, count in (("ps", num_ps), (master_node, num_master), ("evaluator", num_eval),
                        ("worker", num_workers)):
        if count and role:
            template[role], executors = executors[:count], executors[count:]
    logger.info(f"cluster_template: {template}")
    default_fs = _default_fs(sc)
    working_dir = os.getcwd()
    main = _node.wrap_main(map_fun, master_node or None, default_fs, working_dir, queues)
    try:
        core = _ember_run(sc, main, tf_args, num_executors=num_executors, num_ps=num_ps,
                          tensorboard=tensorboard, input_mode=InputMode(int(input_mode)),
                          log_dir=log_dir, driver_ps_nodes=driver_ps_nodes,
                          master_node="chief" if master_node else None,
                          reservation_timeout=reservation_timeout, eval_node=eval_node,
                          env=_node_env(sc), encrypt=encrypt)
    except (TimeoutError, RuntimeError) as exc:
        if isinstance(exc, EmberNodeError):
            raise
        raise RuntimeError(f"TFCluster.run: the cluster of {num_executors} nodes did not start: "
                           f"{exc}\nlikely cause: {_why_not_registered(sc, num_executors)}"
                           ) from exc

    cluster = TFCluster()
    cluster.sc = sc
    cluster.defaultFS = default_fs
    cluster.working_dir = working_dir
    cluster.num_executors = num_executors
    cluster.cluster_id = random.getrandbits(64)
    cluster.input_mode = input_mode
    cluster.queues = queues
    cluster.server = core
    tb = core.tensorboard_url()
    cluster.cluster_info = [
        dict(executor_id=n["index"], host=n["host"],
             job_name=(master_node if n["role"] == "chief" and master_node else n["role"]),
             task_index=n["task_index"], port=n["ports"][0],
             tb_port=(int(tb.rsplit(":", 1)[1]) if tb and n is core.tensorboard_node() else 0),
             spark_executor=n["executor_id"], pid=n["pid"])
        for n in core.nodes]
    cluster.cluster_meta = dict(id=cluster.cluster_id, cluster_template=template,
                                num_executors=num_executors, default_fs=default_fs,
                                working_dir=working_dir, release_port=release_port)
    cluster.meta = cluster.cluster_meta  # type: ignore[attr-defined]
    if tb:
        logger.info(f"TensorBoard running at: {tb}")
    return cluster
