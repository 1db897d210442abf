"""Node side of the TensorFlowOnSpark layer: TFoS's ``ctx`` and ``DataFeed`` over Ember's.

A TFoS node had one ``multiprocessing.Manager`` per executor with named queues
(``input``, ``output``, ``error``...) fed by pickled records.  Here the node's
single C feed server carries everything; this module splits it into TFoS's
named queues.  Each ``train``/``inference`` call is one feed call of the core
cluster (``ember.spark``), and each of its partitions starts with a 'start'
item whose tag names the queue (the call's ``qname``), whether results are
wanted and whether the call is a DStream's micro-batch; the call's other
items carry its id.  So a node routes each call's batches to the queue the
driver named, knows which batches need no results, and, for a DStream, keeps
reading across micro-batches.

Nothing here imports pyspark (node processes do not need it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence


from ember.node import partition_tag

logger = logging.getLogger("ember.compat.tfos")

_FOREVER = 10.0 ** 9  # TFoS's next_batch blocks until data or the end of the feed


def cluster_spec_of(nodes: Sequence[Dict[str, Any]],
                    master_node: Optional[str]) -> Dict[str, List[str]]:
    """TFoS's cluster spec: role -> ["host:port"] in executor order (ps, master, evaluator,
    workers), the evaluator included, the chief named ``master_node``."""
    spec: Dict[str, List[str]] = {}
    for n in sorted(nodes, key=lambda n: n["index"]):
        role = master_node if n["role"] == "chief" and master_node else n["role"]
        spec.setdefault(role, []).append(f"{n['host']}:{n['ports'][0]}")
    return spec


def tf_config_of(spec: Dict[str, List[str]], job_name: str, task_index: int) -> Optional[str]:
    """TF_CONFIG as TFoS exported it: only when the cluster has a master or chief."""
    if "master" not in spec and "chief" not in spec:
        return None
    return json.dumps({"cluster": spec, "task": {"type": job_name, "index": task_index},
                       "environment": "cloud"})


# --------------------------------------------------------------------------- queues

class _Demux:
    """Splits this node's feed server into TFoS's named queues (thread-safe)."""

    def __init__(self, server: Any, queues: Sequence[str]) -> None:
        self.server = server
        self.queues = list(queues)
        self._stash: Dict[str, Deque[Any]] = {q: deque() for q in self.queues}
        self._route: Dict[int, str] = {}  # feed call -> queue name, from its partitions' tags
        self.train_calls: set = set()  # feed calls of train() (no results wanted)
        self.streaming = False
        self.ended = False  # the driver ended the feed (shutdown)
        self._end_item: Any = None
        self._lock = threading.Lock()

    def _queue_of(self, item: Any) -> Optional[str]:
        """The queue an item belongs to, or None for the end of the feed.  A call's
        'start' items come before its other items and name its queue; items of
        no named call (call 0) are for ``input``."""
        if item.kind == "end":
            self.ended, self._end_item = True, item
            return None
        if item.kind == "start":
            tag = partition_tag(item)
            queue = str(tag.get("queue", "input"))
            if queue not in self._stash:
                raise ValueError(f"feed call {item.call} is for queue {queue!r}; this node has "
                                 f"{self.queues}")
            self._route[item.call] = queue
            if not tag.get("results"):
                self.train_calls.add(item.call)
            self.streaming |= bool(tag.get("stream"))
        return self._route.get(item.call, "input")

    def next_for(self, queue: str, timeout: float) -> Any:
        """The next item of ``queue`` (or the end of the feed), None after ``timeout``."""
        if self.streaming and timeout == 0:
            timeout = 0.5  # between micro-batches: wait for the next one
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._stash[queue]:
                    return self._stash[queue].popleft()
                if self.ended:
                    return self._end_item
                left = deadline - time.monotonic()
                # short slices so that a reader of another queue is never held up long
                item = self.server.next(max(0.0, min(left, 0.05)))
                if item is not None:
                    q = self._queue_of(item)
                    if q == queue:
                        return item
                    if q is not None:
                        if q not in self._stash:
                            raise ValueError(f"data for unknown queue {q!r}")
                        self._stash[q].append(item)
                    continue
            if time.monotonic() >= deadline:
                return None


class _QueueView:
    """One named queue of a :class:`_Demux`, shaped as the feed server
    :class:`ember.node.DataFeed` reads from."""

    def __init__(self, demux: _Demux, queue: str) -> None:
        self._demux, self._queue = demux, queue

    def next(self, timeout: float) -> Any:
        return self._demux.next_for(self._queue, timeout)

    def send_results(self, source: int, cols: Any, n: int, timeout: float) -> None:
        self._demux.server.send_results(source, cols, n, timeout)

    def terminate(self) -> None:
        self._demux.server.terminate()


class TFManager:
    """What TFoS code knows as ``ctx.mgr``: the node's feed, by queue name."""

    def __init__(self, ctx: Any, queues: Sequence[str]) -> None:
        self._ctx = ctx
        self.queues = list(queues)
        server = ctx.feed_server
        self._demux = _Demux(server, queues) if server is not None else None
        self._feeds: Dict[Any, Any] = {}
        self._lock = threading.Lock()

    def _core_feed(self, qname: str, train_mode: bool) -> Any:
        if self._demux is None:
            raise RuntimeError(
                f"{self._ctx.job_name}:{self._ctx.task_index} has no data feed: only the "
                "master/chief and worker nodes of an InputMode.SPARK cluster are fed")
        if qname not in self.queues:
            raise Exception(f"Queue '{qname}' not found on this node (queues: {self.queues})")
        with self._lock:
            key = (qname, bool(train_mode))
            if key not in self._feeds:
                # the node's stop check and, after a restart, the report of its
                # first read (the driver feeds from the epoch it names) come with it
                self._feeds[key] = self._ctx.data_feed(
                    _QueueView(self._demux, qname), train_mode, _FOREVER,
                    f"node {self._ctx.worker_num} ({self._ctx.job_name}:"
                    f"{self._ctx.task_index}) queue {qname!r}")
            return self._feeds[key]

    def _stopped(self) -> bool:
        return self._ctx.stop_requested()


class DataFeed:
    """TFoS's ``TFNode.DataFeed(mgr, train_mode, qname_in, qname_out, input_mapping)``.

    ``next_batch(n)`` returns up to ``n`` records: a sequence where ``batch[i]``
    is the record as it was in the RDD (TFoS returned a list), with Ember's
    fast path ``batch.columns`` (one numpy array per field); with
    ``input_mapping``, a dict of tensor name -> column, as TFoS.

    Ends of data: for an RDD ``train()`` call, a node's share ends when it has
    read every partition routed to it (``should_stop()`` turns True and
    ``next_batch`` returns what is left, possibly nothing), so nodes given
    uneven partitions all see their end instead of blocking until
    ``shutdown``; a later ``train()`` call starts a new round.  For a DStream,
    ``next_batch`` waits across micro-batches, as TFoS, until ``shutdown``.
    """

    def __init__(self, mgr: Any, train_mode: bool = True, qname_in: str = "input",
                 qname_out: str = "output", input_mapping: Optional[Dict[str, str]] = None) -> None:
        if not isinstance(mgr, TFManager):
            raise TypeError("DataFeed needs the node's ctx.mgr (a TFNodeContext's manager), "
                            f"got {type(mgr).__name__}")
        self.mgr = mgr
        self.train_mode = train_mode
        self.qname_in = qname_in
        self.qname_out = qname_out
        self.input_tensors = ([tensor for col, tensor in sorted(input_mapping.items())]
                              if input_mapping is not None else None)
        self._feed = mgr._core_feed(qname_in, train_mode)
        assert mgr._demux is not None  # _core_feed raised otherwise
        self._demux: _Demux = mgr._demux
        self._terminated = False
        self._train_batches_unanswered = False

    @property
    def done_feeding(self) -> bool:
        return self.should_stop()

    def _streaming(self) -> bool:
        return self._demux.streaming

    def _read(self, n: int) -> Any:
        batch = self._feed.next_batch(n)
        if not self.train_mode and len(batch) and \
                self._feed.last_batch_call in self._demux.train_calls:
            # an inference-mode feed reading train() data (TFoS's keras example does
            # this): those batches want no results, so do not hold them for results
            self._feed.skip_results()
            self._train_batches_unanswered = True
        return batch

    def next_batch(self, batch_size: int) -> Any:
        """Up to ``batch_size`` records (fewer only at the end of the data)."""
        batch = self._read(batch_size)
        if self._streaming() and len(batch) < batch_size:
            # TFoS: a batch is short only at the end of the feed
            parts = [batch] if len(batch) else []
            got = len(batch)
            while got < batch_size and not self._feed_ended():
                more = self._read(batch_size - got)
                if len(more):
                    parts.append(more)
                    got += len(more)
            if len(parts) != 1:
                batch = [rec for part in parts for rec in part]
            else:
                batch = parts[0]
        if self.input_tensors is None:
            return batch
        return self._mapped(batch)

    def _mapped(self, batch: Any) -> Dict[str, Any]:
        tensors: Dict[str, Any] = {t: [] for t in self.input_tensors or []}
        if not len(batch):
            return tensors
        if hasattr(batch, "columns"):
            cols = list(batch.columns)
            if len(cols) == 1 and len(self.input_tensors or []) > 1:
                cols = [[rec[i] for rec in batch] for i in range(len(self.input_tensors or []))]
        else:
            cols = [[rec[i] for rec in batch] for i in range(len(self.input_tensors or []))]
        if len(cols) < len(self.input_tensors or []):
            raise ValueError(f"input_mapping names {len(self.input_tensors or [])} tensors but "
                             f"records have {len(cols)} fields")
        for i, t in enumerate(self.input_tensors or []):
            tensors[t] = cols[i]
        return tensors

    def _feed_ended(self) -> bool:
        return self._terminated or self._demux.ended or self.mgr._stopped()

    def should_stop(self) -> bool:
        """True once this node's data has ended (see the class doc) or after ``terminate()``."""
        if self._terminated:
            return True
        if self._streaming():
            return self._feed_ended()
        return self._feed.should_stop()

    def batch_results(self, results: Any) -> None:
        """One result per record of the oldest batch still awaiting results."""
        if not self._feed.awaiting_results and self._train_batches_unanswered:
            return  # results for train() data: TFoS queued them where nobody read them
        self._feed.batch_results(results)

    def terminate(self) -> None:
        """Stops the feed: feeding tasks finish at once and drop what is left."""
        self._terminated = True
        self._feed.terminate()


# --------------------------------------------------------------------------- context

def hdfs_path(ctx: Any, path: str) -> str:
    """TFoS's ``TFNode.hdfs_path``: an absolute, scheme-qualified path for ``path``."""
    schemes = ["adl://", "file://", "hdfs://", "oss://", "s3://", "s3a://", "s3n://",
               "swift://", "viewfs://", "wasb://"]
    if any(path.startswith(s) for s in schemes):
        return path
    if path.startswith("/"):
        return ctx.defaultFS + path
    if ctx.defaultFS.startswith("hdfs://") or ctx.defaultFS.startswith("viewfs://"):
        import getpass

        return "{0}/user/{1}/{2}".format(ctx.defaultFS, getpass.getuser(), path)
    if ctx.defaultFS.startswith("file://"):
        return "{0}/{1}/{2}".format(ctx.defaultFS, ctx.working_dir[1:], path)
    logger.warning(f"unknown scheme {ctx.defaultFS} with relative path {path}: using "
                   f"{ctx.defaultFS}/{path} (give an absolute URI to choose)")
    return "{0}/{1}".format(ctx.defaultFS, path)


class TFNodeContext:
    """TFoS's ``ctx``: ``executor_id``, ``worker_num``, ``job_name``, ``task_index``,
    ``cluster_spec``, ``num_workers``, ``defaultFS``, ``working_dir``, ``mgr``.

    Attributes TFoS did not have (``host``, ``ports``, ``report_progress``,
    ``allreduce``, ...) come from the underlying :class:`ember.node.NodeContext`.
    """

    def __init__(self, executor_id: int = 0, job_name: str = "", task_index: int = 0,
                 cluster_spec: Optional[Dict[str, List[str]]] = None, defaultFS: str = "file://",
                 working_dir: str = ".", mgr: Any = None, tmp_socket: Any = None) -> None:
        cluster_spec = cluster_spec or {}
        self.worker_num = executor_id
        self.executor_id = executor_id
        self.job_name = job_name
        self.task_index = task_index
        self.cluster_spec = cluster_spec
        self.num_workers = sum(len(v) for k, v in cluster_spec.items()
                               if k in ("master", "chief", "worker"))
        self.defaultFS = defaultFS
        self.working_dir = working_dir
        self.mgr = mgr
        self.tmp_socket = tmp_socket
        self._ember_ctx: Any = None

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_ember_ctx")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def absolute_path(self, path: str) -> str:
        """``TFNode.hdfs_path(ctx, path)``."""
        return hdfs_path(self, path)

    def get_data_feed(self, train_mode: bool = True, qname_in: str = "input",
                      qname_out: str = "output", input_mapping: Optional[Dict[str, str]] = None
                      ) -> DataFeed:
        return DataFeed(self.mgr, train_mode, qname_in, qname_out, input_mapping)

    def release_port(self) -> None:
        """Releases Ember's hold on this node's TF port (rarely needed: Ember holds it
        with SO_REUSEPORT, not listening, so TF's gRPC server binds it regardless)."""
        if self._ember_ctx is not None:
            self._ember_ctx.release_port()

    def start_cluster_server(self, num_gpus: int = 1, rdma: bool = False) -> Any:
        from ember.compat.tfos import TFNode
        return TFNode.start_cluster_server(self, num_gpus, rdma)

    def export_saved_model(self, sess: Any, export_dir: str, tag_set: str, signatures: Any) -> None:
        from ember.compat.tfos import TFNode
        TFNode.export_saved_model(sess, export_dir, tag_set, signatures)


def node_context(ctx: Any, master_node: Optional[str], default_fs: str, working_dir: str,
                 queues: Sequence[str]) -> TFNodeContext:
    """A TFoS ctx for an Ember node context; exports TF_CONFIG as TFoS did."""
    spec = cluster_spec_of(ctx.nodes, master_node)
    me = next(n for n in ctx.nodes if n["index"] == ctx.worker_num)
    job_name = master_node if me["role"] == "chief" and master_node else me["role"]
    tctx = TFNodeContext(ctx.worker_num, job_name, me["task_index"], spec, default_fs,
                         working_dir)
    tctx.mgr = TFManager(ctx, queues)
    tctx._ember_ctx = ctx
    tf_config = tf_config_of(spec, job_name, me["task_index"])
    if tf_config is None:
        os.environ.pop("TF_CONFIG", None)  # TFoS set none without a master/chief
    else:
        os.environ["TF_CONFIG"] = tf_config
    return tctx


def wrap_main(fn: Callable[[Any, Any], Any], master_node: Optional[str], default_fs: str,
              working_dir: str, queues: Sequence[str]) -> Callable[[Any, Any], Any]:
    """The main_fun Ember runs: builds TFoS's ctx, sets sys.argv for list args, calls ``fn``."""
    queues = list(queues)

    def tfos_main(args: Any, ctx: Any) -> None:
        tctx = node_context(ctx, master_node, default_fs, working_dir, queues)
        if isinstance(args, list):
            sys.argv = args
        fn(args, tctx)

    return tfos_main
