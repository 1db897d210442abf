"""One feeding task per fed node: ``train()``'s data grouped by node, without a shuffle.

Partition ``p`` of a ``train()`` call goes to fed node ``p % n``, or as the
call's routes say (:mod:`ember._routing`).  Fed one
Spark task per partition, a node can starve: Spark may run two partitions of
node 0 at once while node 1 has no feeder, and under a synchronous strategy
(an all-reduce every step) node 0 then stops consuming, waiting for node 1,
so both feeding tasks block until the feed timeout.  Grouped, task ``i``
feeds node ``i``'s partitions (``_routing.node_partitions``, increasing) one
after the other, so every node has its feeder as soon as the job has ``n`` slots.

The grouping is ``ember.spark.NodeGroups`` (Ember's Spark jar): a
``PartitionCoalescer``, so a narrow dependency, no shuffle.  The feeding task
must still see where each partition starts:

- an RDD's JVM elements are pickled batches (or text lines); each partition
  is made to begin with a null element (neither ever is null), which
  :class:`BoundaryDeserializer` turns into :data:`BOUNDARY`.  The RDD's own
  Python functions (a ``PipelinedRDD``'s) run in the feeding task, as
  ``rdd.mapPartitions(feeder)`` would run them: no extra pickling, and their
  errors reach the feeder.  An RDD without any is fed from its pickled
  batches as they are, none unpickled where they are of the common form
  (:func:`frame_chunks`);
- a DataFrame gets its partition id as a column (``spark_partition_id()``)
  and stays on Spark's Arrow path (``mapInArrow``); the feeding task splits
  Arrow batches where that column changes (:func:`arrow_partitions`) and
  drops it.

Driver-side functions import pyspark; the splitters run in feeding tasks.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import deque
from typing import AbstractSet, Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from pyspark.serializers import (AutoBatchedSerializer, BatchedSerializer, CloudPickleSerializer,
                                 FramedSerializer, PickleSerializer, SpecialLengths,
                                 UTF8Deserializer, read_int)

from ember import _ember
from ember.errors import EmberError

logger = logging.getLogger("ember.grouping")

#: The feeding task's mark of a partition's start in a grouped RDD.
BOUNDARY = type("PartitionBoundary", (), {"__repr__": lambda self: "<partition boundary>"})()
_END = object()  # the end of a grouped RDD's records
#: The column of a grouped DataFrame that holds each row's partition (dropped before feeding).
PARTITION_COLUMN = "__ember_partition__"
_JAVA_CLASS = "ember.spark.NodeGroups"
_jar_lock = threading.Lock()  # one ADD JAR per driver
_PICKLES = (PickleSerializer, CloudPickleSerializer)


# --------------------------------------------------------------------------- driver

def java_class(sc: Any, name: str = _JAVA_CLASS) -> Any:
    """The class ``name`` of Ember's Spark jar (``ember.spark.NodeGroups``
    unless named), after adding Ember's Spark jar to the session
    (``ADD JAR``: the driver and the executors) if ``spark.jars`` did not;
    None when the jar is missing.  Raises SparkVersionError when the jar was
    built for another Scala version (:func:`ember._jars.check_spark_jar`).

    py4j finds classes through the calling thread's context class loader, and
    ``ADD JAR`` sets only its own thread's: other threads get the session's
    jar class loader set when the plain lookup fails."""
    import os

    from py4j.java_gateway import JavaClass
    from pyspark.sql import SparkSession

    from ember import _jars

    _jars.check_spark_jar(sc)

    def lookup() -> Any:
        cls = sc._jvm
        for part in name.split("."):
            cls = getattr(cls, part)
        return cls if isinstance(cls, JavaClass) else None

    cls = lookup()
    if cls is not None or not os.path.exists(_jars.SPARK_JAR):
        return cls
    spark = SparkSession.builder.getOrCreate()
    with _jar_lock:
        cls = lookup()
        if cls is None:
            loader = spark._jsparkSession.sharedState().jarClassLoader()
            sc._jvm.java.lang.Thread.currentThread().setContextClassLoader(loader)
            cls = lookup()
        if cls is None:
            spark.sql(f"ADD JAR '{_jars.SPARK_JAR}'")
            cls = lookup()
    return cls


def task_slots(sc: Any) -> Optional[int]:
    """How many tasks the cluster can run at once now (None if Spark cannot say)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager()
                                             .defaultResourceProfile()))
    except Exception:  # a diagnostic only
        return None


def _readable(ser: Any) -> bool:
    """Whether :class:`BoundaryDeserializer` reads what ``ser`` reads: pickles
    (batched or not) or UTF-8 text (``sc.textFile``)."""
    if type(ser) in (BatchedSerializer, AutoBatchedSerializer):
        ser = ser.serializer
    return type(ser) in _PICKLES or type(ser) is UTF8Deserializer


#: A grouped call's wish for routes: (partitions per epoch, each fed node's
#: host names); see :func:`ember._routing.local_routes`.
LocalTo = Tuple[int, Sequence[AbstractSet[str]]]


def group_rdd(rdd: Any, groups: Any, nodes: int, first: int,
              local_to: Optional[LocalTo] = None) -> Tuple[Any, Any, Optional[Tuple[int, ...]]]:
    """``rdd`` as one partition per fed node (``groups``: the JVM class from
    :func:`java_class`), each source partition's records preceded by
    :data:`BOUNDARY`; the function ``f(split, records)`` the feeding task
    applies to each source partition (a ``PipelinedRDD``'s Python pipeline,
    as PySpark runs it; None for none); and the call's routes, chosen from
    where the partitions are when ``local_to`` asks for them (None:
    round-robin)."""
    from pyspark import RDD
    from pyspark.rdd import PipelinedRDD

    count = rdd.getNumPartitions()
    if isinstance(rdd, PipelinedRDD) and rdd._is_pipelinable() and \
            _readable(rdd._prev_jrdd_deserializer):
        jrdd, ser, func = rdd._prev_jrdd, rdd._prev_jrdd_deserializer, rdd.func
    else:
        if not _readable(rdd._jrdd_deserializer):  # pairs, raw bytes: pickle them
            rdd = rdd.map(lambda x: x)
        jrdd, ser, func = rdd._jrdd, rdd._jrdd_deserializer, None
    routes = _routes(groups, jrdd.rdd(), local_to)
    grouped = groups.groupPython(jrdd, nodes, first, count, _java_routes(rdd.ctx, routes))
    # with no Python function to run on the records, the feeding task reads
    # them where they lie in Spark's pickled batches (frame_chunks)
    return RDD(grouped, rdd.ctx, BoundaryDeserializer(ser, frames=func is None)), func, routes


def group_dataframe(df: Any, groups: Any, nodes: int, first: int, expected: int,
                    local_to: Optional[LocalTo] = None) -> Tuple[Any, Optional[Tuple[int, ...]]]:
    """``df`` plus :data:`PARTITION_COLUMN` as one partition per fed node, and
    the call's routes (as :func:`group_rdd`)."""
    from pyspark.sql import DataFrame
    from pyspark.sql.functions import spark_partition_id

    # spark_partition_id() is nondeterministic: the optimizer keeps it where
    # it is, over the epochs' union, so it numbers the union's partitions
    tagged = df.withColumn(PARTITION_COLUMN, spark_partition_id())
    rows = groups.rowsOf(tagged._jdf)
    routes = _routes(groups, rows, local_to)
    grouped = groups.groupRows(tagged._jdf, rows, nodes, first, expected,
                               _java_routes(df.sparkSession.sparkContext, routes))
    return DataFrame(grouped, df.sparkSession), routes


def _routes(groups: Any, jrdd: Any, local_to: Optional[LocalTo]) -> Optional[Tuple[int, ...]]:
    """Routes giving each fed node the partitions held on its host
    (:func:`ember._routing.local_routes`) of the JVM RDD ``jrdd`` (the epochs'
    union: its first ``per_epoch`` partitions are the data's), or None."""
    from ember import _routing

    if local_to is None:
        return None
    per_epoch, node_hosts = local_to
    where = [set().union(*(_routing.host_names(str(h)) for h in hosts))
             for hosts in groups.hosts(jrdd, per_epoch)]
    routes = _routing.local_routes(where, node_hosts)
    if routes is None:
        return None
    logger.info(f"train: each node gets the partitions held on its host (routes {routes})")
    return tuple(routes)


def _java_routes(sc: Any, routes: Optional[Sequence[int]]) -> Any:
    """``routes`` as a Java int[] (None: round-robin)."""
    if not routes:
        return None
    array = sc._gateway.new_array(sc._jvm.int, len(routes))
    for i, n in enumerate(routes):
        array[i] = int(n)
    return array


class InputBroken(EmberError, RuntimeError):
    """The stream from Spark to the feeding task ended without Spark's end
    mark: a stage upstream failed, and Spark reports its error.  Not the end
    of a partition."""


class BoundaryDeserializer(FramedSerializer):
    """Reads a grouped RDD: a NULL frame is :data:`BOUNDARY`; any other is a
    batch of the source's pickled records, one pickled record, or a line of
    text, as the source's deserializer ``source`` reads it.

    ``frames`` (batched pickles only): the stream's items are whole batches,
    not records: each as ``_ember.PickledRecords`` (read where they lie in
    the pickle, not unpickled) or, when the batch is not of the form that
    reads (:func:`ember._ember.scan_pickled`), as the list of its records.
    :func:`frame_chunks` cuts them into the feed's chunks."""

    def __init__(self, source: Any, frames: bool = False) -> None:
        super().__init__()
        self._batched = type(source) in (BatchedSerializer, AutoBatchedSerializer)
        inner = source.serializer if self._batched else source
        self._text = type(inner) is UTF8Deserializer
        self._unicode = bool(getattr(inner, "use_unicode", True))
        self._inner = inner
        self.frames = frames and self._batched and not self._text

    def load_stream(self, stream: Any) -> Iterator[Any]:
        if self.frames:
            return self._frames(stream)
        # Flattened in C, as PySpark's own batched reader is: a generator
        # that yielded each record would resume a Python frame per record.
        return itertools.chain.from_iterable(self._frames(stream))

    def _frames(self, stream: Any) -> Iterator[Any]:
        """The stream's frames, each as the list of what it holds."""
        while True:
            try:
                length = read_int(stream)
            except EOFError:
                raise InputBroken("ember: Spark's input to the feeding task ended "
                                  "without its end mark") from None
            if length == SpecialLengths.END_OF_DATA_SECTION:
                return
            if length == SpecialLengths.NULL:
                yield BOUNDARY if self.frames else [BOUNDARY]
                continue
            data = stream.read(length)
            if len(data) < length:
                raise InputBroken("ember: Spark's input to the feeding task broke off "
                                  "within a record")
            if self._text:
                yield [data.decode("utf-8") if self._unicode else data]
            elif self.frames:
                scanned = _ember.scan_pickled(data)
                yield self._inner.loads(data) if scanned is None else scanned
            elif self._batched:
                yield self._inner.loads(data)  # a pickled list of records
            else:
                yield [self._inner.loads(data)]

    def dumps(self, obj: Any) -> bytes:
        raise NotImplementedError("BoundaryDeserializer only reads")

    def __repr__(self) -> str:
        return (f"BoundaryDeserializer({self._inner!r}, batched={self._batched}, "
                f"frames={self.frames})")


# --------------------------------------------------------------------------- feeding task

def partitions(items: Any, group: List[int]) -> Iterator[Tuple[int, Iterator[Any]]]:
    """Splits a grouped RDD's records at its boundaries: ``(p, records)`` for
    each partition ``p`` of ``group`` in turn.  Records a consumer leaves
    unread are skipped before the next partition."""
    ended: List[bool] = []

    def end_mark() -> Iterator[Any]:
        ended.append(True)
        return
        yield  # a generator: chain() runs it once the records run out

    it = itertools.chain(items, end_mark())
    head = next(it, _END)
    for p in group:
        if head is not BOUNDARY:
            raise RuntimeError(f"ember: the grouped feed lacks the start of partition {p}")
        # Up to the next BOUNDARY (taken with it) or the end: iter(callable,
        # sentinel) and next() step in C, with no Python frame per record.
        body = iter(functools.partial(next, it, BOUNDARY), BOUNDARY)
        yield p, body
        for _ in body:  # what the consumer did not read (it stopped early)
            pass
        head = _END if ended else BOUNDARY
    if head is not _END:
        raise RuntimeError(f"ember: the grouped feed holds more than partitions {group}")


def frame_chunks(frames: Iterator[Any], skip: int, cut: Dict[str, int]) -> Iterator[Any]:
    """A partition's records, from its frames (the items of
    ``BoundaryDeserializer(frames=True)``), in chunks of ``cut["rows"]``
    records (read at each chunk: the feed cuts it to its ring) after the
    first ``skip``.  A chunk is a tuple of ``_ember.PickledRecords`` (frames
    or slices of them, which the feed writes into its ring straight from the
    pickles) or a list of records (frames that did not scan).  A chunk joins
    frames: PySpark's batches hold 1, 2, 4 ... records, then about 64 KB, and
    the node's batches of one frame each cost a fifth of the feed's speed
    (32 records of 3 KB against 128: 137,000 records/s against 161,000)."""
    pending: List[Any] = []  # records of frames that did not scan
    parts: List[Any] = []  # PickledRecords of the next chunk
    held = 0  # records in parts
    for frame in frames:
        n = len(frame)
        if skip >= n:
            skip -= n
            continue
        if isinstance(frame, list):
            if parts:
                yield tuple(parts)
                parts, held = [], 0
            pending.extend(frame[skip:])
            while len(pending) >= cut["rows"]:
                rows = cut["rows"]
                yield pending[:rows]
                del pending[:rows]
        else:
            if pending:
                yield pending
                pending = []
            at = skip
            while at < n:
                take = min(n - at, max(1, cut["rows"] - held))
                parts.append(frame if take == n else frame.slice(at, at + take))
                held += take
                at += take
                if held >= cut["rows"]:
                    yield tuple(parts)
                    parts, held = [], 0
        skip = 0
    if parts:
        yield tuple(parts)
    if pending:
        yield pending


def arrow_partitions(batches: Any, group: Optional[List[int]], first: int
                     ) -> Iterator[Tuple[int, Iterator[Any]]]:
    """Splits a grouped DataFrame's Arrow batches by :data:`PARTITION_COLUMN`
    (dropped): ``(p, record batches)`` for each partition ``p`` of ``group``
    in turn, empty partitions included (the rows say nothing of those).
    ``group`` None: the partitions the rows name, in their order (each one
    contiguous), none empty."""
    import numpy as np

    queue: Deque[Tuple[int, Any]] = deque()  # runs (p, rows) read ahead: one batch's
    source = iter(batches)
    done = False

    def fill() -> bool:
        nonlocal done
        while not queue and not done:
            rb = next(source, None)
            if rb is None:
                done = True
                break
            at = rb.schema.get_field_index(PARTITION_COLUMN)
            ids = rb.column(at).to_numpy(zero_copy_only=False)
            rb = rb.drop_columns([PARTITION_COLUMN]) if hasattr(rb, "drop_columns") \
                else rb.remove_column(at)
            if not len(ids):
                continue
            cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ids)]):
                queue.append((first + int(ids[lo]), rb.slice(int(lo), int(hi - lo))))
        return bool(queue)

    def rows(p: int) -> Iterator[Any]:
        while fill() and queue[0][0] == p:
            yield queue.popleft()[1]

    if group is None:
        seen: Set[int] = set()
        while fill():
            p = queue[0][0]
            if p in seen:
                raise RuntimeError(f"ember: the rows of partition {p} are not contiguous")
            seen.add(p)
            body = rows(p)
            yield p, body
            for _ in body:
                pass
        return
    for p in group:
        body = rows(p)
        yield p, body
        for _ in body:
            pass
        if fill() and queue[0][0] not in group[group.index(p) + 1:]:
            raise RuntimeError(f"ember: partition {queue[0][0]} came after {p} in the "
                               f"grouped feed of partitions {group}")
    if fill():
        raise RuntimeError(f"ember: the grouped feed holds rows of partition {queue[0][0]}, "
                           f"not one of {group}")
