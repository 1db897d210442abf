"""``Cluster.train_stream``'s driver side: a Structured Streaming query whose
micro-batches feed the nodes, every record trained exactly once.

The query runs ``foreachBatch(StreamFeed)``.  Each micro-batch is first
written to the stream's feed log (Parquet under ``<checkpoint>/ember-feed-log/
<id>``, on whatever file system the checkpoint is, local or ``hdfs://``), then
fed from there as one feed call, so that

- a micro-batch is read from the source once, and any later feed of it
  (after a node restart, or a new driver) gets the same records in the same
  partitions;
- the call id is the stream's and the micro-batch's (:func:`call_id`), so when
  a stopped query is restarted and Spark runs its uncommitted micro-batch
  again, the running nodes' feed servers deliver only what they had not got
  (the C feed's per-partition delivery record, ember/feed.h);
- when nodes (re)start, they name the first micro-batch their checkpoint
  lacks (``ctx.resume_from``) and the stream is fed again from there, from
  the log, before Spark's next micro-batch: micro-batches Spark has already
  committed included.

``foreachBatch`` returns once the nodes have taken the whole micro-batch, so
Spark commits a micro-batch only after that, and a trainer slower than the
stream holds the next trigger back (back-pressure).  The log drops the
micro-batches every fed node's checkpoint holds (``ctx.checkpointed``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ember.errors import EmberError, EmberNodeError

if TYPE_CHECKING:  # the driver imports this module
    from ember.driver import Cluster

logger = logging.getLogger("ember.stream")

#: The top bits of a stream micro-batch's feed call id: apart from train()'s
#: and inference()'s sequential ids.
_STREAM_CALL = 1 << 62
_BATCH_BITS = 40  # micro-batch ids below 2**40; the stream's number above them
LOG_DIR = "ember-feed-log"


def call_id(stream: int, micro_batch: int) -> int:
    """The feed call id of ``micro_batch`` of the cluster's ``stream``-th stream:
    the same whenever that micro-batch is fed to the same nodes."""
    if not 0 <= micro_batch < 1 << _BATCH_BITS:
        raise ValueError(f"micro-batch id {micro_batch} is out of Ember's range")
    return _STREAM_CALL | (stream << _BATCH_BITS) | micro_batch


class FeedLog:
    """The micro-batches of one stream as fed, kept until checkpoints hold them.

    ``<root>/<id>/`` is a Parquet directory; its ``_SUCCESS`` marker says the
    micro-batch was written whole.  Reached through Hadoop's FileSystem in the
    driver's JVM, as Spark reaches the checkpoint beside it."""

    def __init__(self, spark: Any, root: str) -> None:
        self.spark, self.root = spark, root.rstrip("/")
        jvm = spark.sparkContext._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self._fs = self._Path(self.root).getFileSystem(
            spark.sparkContext._jsc.hadoopConfiguration())

    def path(self, micro_batch: int) -> str:
        return f"{self.root}/{micro_batch}"

    def complete(self, micro_batch: int) -> bool:
        return bool(self._fs.exists(self._Path(f"{self.path(micro_batch)}/_SUCCESS")))

    def write(self, df: Any, micro_batch: int) -> None:
        df.write.mode("overwrite").parquet(self.path(micro_batch))

    def read(self, micro_batch: int) -> Any:
        return self.spark.read.parquet(self.path(micro_batch))

    def ids(self) -> List[int]:
        """The micro-batches the log holds (written whole or not), in order."""
        root = self._Path(self.root)
        if not self._fs.exists(root):
            return []
        names = [s.getPath().getName() for s in self._fs.listStatus(root)]
        return sorted(int(n) for n in names if n.isdigit())

    def drop_before(self, micro_batch: int) -> int:
        """Deletes the micro-batches before ``micro_batch``; returns how many."""
        dropped = 0
        for b in self.ids():
            if b >= micro_batch:
                break
            self._fs.delete(self._Path(self.path(b)), True)
            dropped += 1
        return dropped


class _QueryStopped(Exception):
    """The query was stopped while its micro-batch waited for the one in flight."""


class StreamFeed:
    """The ``foreachBatch`` function of one stream of a cluster, and what the
    cluster's current nodes have been fed of it."""

    def __init__(self, cluster: "Cluster", number: int, log: FeedLog, feed_timeout: float,
                 qname: str, continuous: bool) -> None:
        self.cluster, self.number, self.log = cluster, number, log
        self.feed_timeout, self.qname, self.continuous = feed_timeout, qname, continuous
        self.query: Any = None  # the running StreamingQuery, once start() returned
        self.fed_through: Optional[int] = None  # the last micro-batch the nodes took whole
        self._generation: Optional[int] = None  # cluster.restarts when fed_through was set
        self._graceful = threading.Event()  # cluster.shutdown(): let a micro-batch finish
        # the micro-batch being fed in the background: (thread, its error)
        self._inflight: Optional[Tuple[threading.Thread, Dict[str, BaseException]]] = None

    # -- the query's side ------------------------------------------------------
    def __call__(self, batch_df: Any, batch_id: int) -> None:
        micro_batch = int(batch_id)
        if not self.log.complete(micro_batch):
            # the source is replayable (as Spark's exactly-once needs), so a
            # micro-batch Spark runs again holds the same records: written
            # once, while the nodes take the micro-batch before
            self.log.write(batch_df, micro_batch)
        cluster = self.cluster
        while True:
            try:
                failure = self._settle() or cluster._failure()
            except _QueryStopped:
                # nothing fed of this micro-batch, and its log is whole: when
                # Spark commits it anyway, the next query's first micro-batch
                # feeds it first (_catch_up)
                return
            if failure is None:
                try:
                    self._catch_up(micro_batch)
                    break
                except EmberNodeError as exc:
                    failure = exc
            cluster._restart_or_raise(failure)  # raises once max_restarts are used
            self.fed_through, self._generation = None, None
        self._start_feed(micro_batch)
        self._drop_checkpointed()

    def _catch_up(self, micro_batch: int) -> None:
        """Feeds the current nodes, one after the other, the micro-batches
        before ``micro_batch`` that they lack: after they (re)started, from
        the position they resume from, out of the log."""
        cluster = self.cluster
        if self._generation != cluster.restarts or self.fed_through is None:
            start = self._resume_point(micro_batch)
            self._generation = cluster.restarts
            self.fed_through = start - 1
            if start > micro_batch:
                logger.info(f"stream {self.number}: the nodes' checkpoints hold micro-batch "
                            f"{micro_batch} already (they resume from {start}): not fed")
        for b in range(self.fed_through + 1, micro_batch):
            if not self.log.complete(b):
                raise EmberError(
                    f"ember train_stream: the nodes resume from micro-batch "
                    f"{self.fed_through + 1}, but the stream's feed log {self.log.root} "
                    f"lacks micro-batch {b} (it holds {self.log.ids() or 'none'}): the "
                    "checkpoint the nodes restored is older than what the log keeps; "
                    "restore a newer checkpoint or restart the query from a fresh "
                    "checkpoint location")
            logger.info(f"stream {self.number}: feeding micro-batch {b} from the feed log "
                        "(the nodes lack it)")
            self._feed(b, cancel_when=self._stopped)
            self.fed_through = b

    def _start_feed(self, micro_batch: int) -> None:
        """Feeds ``micro_batch`` in the background, so that the query writes
        the next one to the log meanwhile: one micro-batch in flight at most."""
        if self.fed_through is not None and micro_batch <= self.fed_through:
            return  # the nodes have it (a replay of a micro-batch they took)

        def feed() -> None:
            try:
                self._feed(micro_batch)
                self.fed_through = micro_batch
            except BaseException as exc:  # the next micro-batch, or stop(), raises it
                outcome["error"] = exc

        outcome: Dict[str, BaseException] = {}
        thread = threading.Thread(target=feed, name=f"ember-stream-{self.number}-{micro_batch}",
                                  daemon=True)
        self._inflight = (thread, outcome)
        thread.start()

    def _settle(self) -> Optional[EmberNodeError]:
        """Waits for the micro-batch in flight to be taken whole.  Returns the
        node failure that broke it, raises any other error; raises
        :class:`_QueryStopped` when the query is stopped meanwhile (the
        micro-batch in flight goes on: Spark committed it)."""
        if self._inflight is None:
            return None
        thread, outcome = self._inflight
        while thread.is_alive():
            thread.join(0.5)
            if thread.is_alive() and self._stopped():
                raise _QueryStopped()
        self._inflight = None
        error = outcome.get("error")
        if isinstance(error, EmberNodeError):
            return error
        if error is not None:
            raise error
        return None

    def _resume_point(self, micro_batch: int) -> int:
        """After nodes started: the first micro-batch any fed node's checkpoint
        lacks (``ctx.resume_from``); ``micro_batch`` when none names one."""
        named = self.cluster._await_resume_reports(self.feed_timeout, "train_stream")
        return min(named) if named else micro_batch

    def _feed(self, micro_batch: int, cancel_when: Any = None) -> int:
        cluster = self.cluster
        df = self.log.read(micro_batch)
        nodes = len(cluster._feed_targets())
        if df.rdd.getNumPartitions() < nodes:
            # every fed node gets a round for every micro-batch (DataFeed.micro_batches):
            # a synchronous trainer's nodes meet in each
            df = df.repartition(nodes)
        return cluster._feed_once(
            df, 1, self.feed_timeout, qname=self.qname, stream=self.continuous,
            seq=call_id(self.number, micro_batch), micro_batch=micro_batch,
            cancel_when=cancel_when)

    def _stopped(self) -> bool:
        """True once the query was stopped, not by cluster.shutdown() (which
        lets the query's micro-batch finish)."""
        query = self.query
        return query is not None and not self._graceful.is_set() and not query.isActive

    def _drop_checkpointed(self) -> None:
        held = self.cluster._checkpointed_through()
        if held is not None:
            dropped = self.log.drop_before(held)
            if dropped:
                logger.info(f"stream {self.number}: dropped {dropped} micro-batch(es) before "
                            f"{held} from the feed log (every fed node's checkpoint holds them)")

    # -- the cluster's side ----------------------------------------------------
    def restart_query(self) -> None:
        """Before the query (re)starts: a stop by the user cancels again."""
        self._graceful.clear()
        self.query = None

    def stop(self) -> None:
        """Stops the query after its micro-batch, and waits until the nodes have
        taken every micro-batch it committed.  A node's failure is left to
        the cluster to raise; any other error is logged (the micro-batch stays
        in the feed log, and a restart of the query feeds it)."""
        self._graceful.set()
        query = self.query
        if query is not None and query.isActive:
            query.stop()
        try:
            self._settle()  # graceful: never _QueryStopped
        except Exception as exc:
            logger.warning(f"stream {self.number}: a micro-batch was not fed whole: {exc}; "
                           "it stays in the feed log, and a restart of the query feeds it")
