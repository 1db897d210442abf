"""The per-node context handed to ``main_fun(args, ctx)``, and its data feed.

``ctx`` tells a node who it is in the cluster (``job_name``, ``task_index``,
``worker_num``, ``cluster_spec``...), and ``ctx.get_data_feed()`` returns the
:class:`DataFeed` through which ``cluster.train(rdd)`` and
``cluster.inference(rdd)`` deliver records (InputMode.SPARK).  Batches arrive
from the C feed server as contiguous buffers and surface as numpy arrays that
view that memory without a copy.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ember import _columns, _ember, _routing
from ember.errors import FeedProducerError

#: The code of the control-channel progress REPORT by which a node tells the
#: driver the epoch it resumes from (text: the epoch; empty: the node reads its
#: feed without naming one).  See :meth:`NodeContext.resume_from`.
RESUME_REPORT = 0x52534D  # "RSM"
#: The code of the progress REPORT by which a node tells the driver that its
#: model's checkpoint holds every micro-batch of a stream before the one named
#: (text: that micro-batch id).  See :meth:`NodeContext.checkpointed`.
CHECKPOINT_REPORT = 0x434B50  # "CKP"
#: The code of the progress REPORT by which a chief or worker node tells the
#: driver it now serves (a framework's server, e.g. a worker of TensorFlow's
#: ParameterServerStrategy) until it is stopped: shutdown then waits for the
#: other trainers only, and stops it.  See :meth:`NodeContext.serve_until_stopped`.
SERVING_REPORT = 0x535256  # "SRV"

logger = logging.getLogger("ember.node")


class Batch(Sequence):
    """A batch from :meth:`DataFeed.next_batch`.

    It is a sequence of records, as TensorFlowOnSpark's ``next_batch`` returned
    (``batch[i]`` is a tuple of fields, or the plain value for non-tuple
    records), and it exposes the fast path: ``batch.columns``, one numpy array
    per field with the row axis first (zero-copy when the batch lies within one
    received chunk), and ``batch.names``.
    """

    __slots__ = ("names", "columns", "_rows")

    def __init__(self, names: List[str], columns: List[Any], rows: int) -> None:
        self.names = names
        self.columns = tuple(columns)
        self._rows = rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._rows))]
        if i < 0:
            i += self._rows
        if not 0 <= i < self._rows:
            raise IndexError("batch index out of range")
        if len(self.columns) == 1 and self.names[0] == _columns.VALUE_FIELD:
            return self.columns[0][i]
        return tuple(c[i] for c in self.columns)

    def column(self, name: str) -> Any:
        """The column of field ``name`` (Row field name or tuple position)."""
        return self.columns[self.names.index(name)]


#: _next_chunk(await_round=True)'s answer: the next call's first partition is here.
_ROUND = object()


class _Chunk:
    """One received feed item and how far the consumer has read into it."""

    __slots__ = ("item", "names", "columns", "rows", "pos", "source", "results", "answered",
                 "epoch")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.names, self.columns = _columns.item_columns(item)
        self.rows = item.nrows
        self.pos = 0
        self.source = item.source
        self.results: List[Any] = []  # inference results given so far, in order
        self.answered = 0
        self.epoch: Optional[int] = None  # train(): the epoch of its partition


def partition_tag(item: Any) -> Dict[str, Any]:
    """The description a feeding task gave its partition (a 'start' item's tag,
    see ``ember.executor.partition_tag``): queue, results, stream, plan."""
    if not item.tag:
        return {}
    try:
        tag = json.loads(item.tag)
    except ValueError as exc:
        raise ValueError(f"partition {item.partition} of feed call {item.call}: its tag is not "
                         f"JSON ({item.tag[:80]!r})") from exc
    return tag if isinstance(tag, dict) else {}


class DataFeed:
    """Records pushed into this node by ``cluster.train`` / ``cluster.inference``.

    Typical training loop::

        feed = ctx.get_data_feed()
        while not feed.should_stop():
            batch = feed.next_batch(64)
            if len(batch) == 0:
                break
            x, y = batch.columns

    In inference, call :meth:`batch_results` with one result per record of each
    batch, in order; results travel back to the feeding Spark task.

    A feeding task that fails (its partition's iterator raised, a record did
    not convert) marks the failure in the feed after the batches it sent.
    ``on_producer_error="wait"`` (the default) logs it, records the reason in
    :attr:`producer_errors` and keeps reading: Spark retries the task and the
    retry sends only the records not yet delivered.  ``"raise"`` raises
    :class:`FeedProducerError` from ``next_batch`` instead.

    Epochs: in ``train(rdd, num_epochs=k)`` every partition is labelled with
    its epoch (0..k-1, counted within the call).  A batch never mixes two
    epochs: :attr:`epoch` is the epoch of the last batch returned, and
    :attr:`epochs_done` counts the epochs this node has read whole, so a
    trainer can count and checkpoint per epoch and, after a restart, name the
    epoch it resumes from with :meth:`NodeContext.resume_from`.  The epochs of
    one call are fed as one Spark job, so near an epoch's end a node may get
    batches of the next epoch before the last ones of its own: the labels,
    not the order, tell them apart.
    """

    def __init__(self, server: Any, train_mode: bool = True, feed_timeout: float = 600.0,
                 stop_check: Any = None, node_name: str = "node",
                 on_producer_error: str = "wait", skip_before: Optional[int] = None) -> None:
        if on_producer_error not in ("wait", "raise"):
            raise ValueError(f"on_producer_error must be 'wait' or 'raise', not "
                             f"{on_producer_error!r}")
        self._on_producer_error = on_producer_error
        #: why feeding tasks failed (their batches before the failure were delivered)
        self.producer_errors: List[str] = []
        self._server = server
        self.train_mode = train_mode
        self._feed_timeout = feed_timeout
        self._stop_check = stop_check
        self._node_name = node_name
        self._chunk: Optional[_Chunk] = None
        self._ended = False
        self._terminated = False
        # the current feed call (train() or inference()): its id, the partitions
        # that ended, whether its end (CALL_END) was read; the feed marks them
        self._call = -1
        self._call_ended: set = set()
        self._call_done = False
        self._call_stream = False  # one micro-batch of a stream: its end is not the data's
        self._micro_batch: Optional[int] = None  # the stream micro-batch of the current call
        self._read_through: Optional[int] = None  # the last micro-batch read whole
        # a stream's micro-batches before this one are dropped (ctx.resume_from)
        self._skip_before = skip_before
        self._skipped: set = set()  # the calls of those micro-batches
        self._epochs: Dict[int, int] = {}  # partition -> its epoch, from the partitions' tags
        # train(): the call's partitions per epoch, first and end partition, fed
        # nodes, routes and this node (ember._routing), from the partitions' tags
        self._plan: Optional[Tuple[int, int, int, int, Tuple[int, ...], int]] = None
        #: the epoch (within its train() call) of the last batch ``next_batch``
        #: returned; None before the first, and for data of ``inference``
        self.epoch: Optional[int] = None
        self._last_call: Optional[int] = None  # the feed call of the last batch returned
        self._on_first_read: Any = None  # called once, before the first read (ctx)
        # inference: chunks whose results are not yet complete, oldest first
        self._awaiting: Deque[Any] = deque()  # (chunk, rows handed out), oldest first

    # -- reading ----------------------------------------------------------
    def _next_chunk(self, await_round: bool = False) -> Any:
        """The next chunk of data; None at the end of the call or of the feed.
        With ``await_round``, waits (without feed_timeout) for the first
        partition of the next call instead, and returns :data:`_ROUND` then."""
        if self._on_first_read is not None:
            hook, self._on_first_read = self._on_first_read, None
            hook()
        # a stream's micro-batches come when the query has them: no deadline
        deadline = None if await_round or self._micro_batch is not None else \
            time.monotonic() + self._feed_timeout
        while True:
            if self._stop_check is not None and self._stop_check():
                self._ended = True
                return None
            # at the end of a train() call, look without waiting for a later call's data
            done = self._call_done and not await_round
            if done and self._micro_batch is not None:
                return None  # a stream's next micro-batch starts with micro_batches()
            item = self._server.next(0 if done else 1.0)
            if item is None and done:
                return None
            if item is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self._node_name}: no data arrived on the feed for "
                        f"{self._feed_timeout:.0f} s (feed_timeout); is cluster.train() running?")
                continue
            if item.kind == "end":
                self._ended = True
                return None
            if item.kind == "error":
                # A feeding task failed half-way.  Spark retries it and the
                # retry resumes after the records delivered here (exactly
                # once), so by default the trainer keeps going.
                self.producer_errors.append(item.reason)
                if self._on_producer_error == "raise":
                    raise FeedProducerError(f"{self._node_name}: {item.reason}")
                logger.warning(f"{self._node_name}: {item.reason} (its records so far were "
                               "delivered; Spark's retry of the task sends the rest; "
                               "on_producer_error='raise' makes next_batch raise instead)")
                continue
            kind = item.kind
            if item.call in self._skipped:
                continue  # a micro-batch the checkpoint resumed from already holds
            if kind == "start":  # a partition of a named call begins: its tag says how
                tag = partition_tag(item)
                micro_batch = tag.get("micro_batch")
                if micro_batch is not None and self._skip_before is not None and \
                        micro_batch < self._skip_before:
                    self._skipped.add(item.call)
                    logger.info(f"{self._node_name}: dropping micro-batch {micro_batch}: its "
                                f"checkpoint resumes from micro-batch {self._skip_before}")
                    continue
                new = item.call != self._call
                self._start_call(item.call)
                self._call_stream = bool(tag.get("stream"))
                self._micro_batch = micro_batch
                plan = tag.get("plan")
                if plan:
                    per_epoch, first, end, nodes = (int(v) for v in plan)
                    routes = tuple(int(n) for n in tag.get("routes") or ())
                    self._epochs[item.partition] = item.partition // per_epoch
                    self._plan = (per_epoch, first, end, nodes, routes,
                                  _routing.node_of(item.partition, nodes, routes))
                if await_round and new:
                    return _ROUND
                continue
            if kind == "partition_end":
                self._start_call(item.call)
                self._call_ended.add(item.partition)
                continue
            if kind == "call_end":
                self._start_call(item.call)
                if self._micro_batch is not None:
                    self._read_through = self._micro_batch
                if self._call_stream:
                    continue  # a stream's data goes on with its next micro-batch
                self._call_done = True
                if await_round:
                    continue
                return None
            if item.nrows == 0:
                continue
            chunk = _Chunk(item)
            self._start_call(item.call)
            chunk.epoch = self._epochs.get(item.partition)
            if await_round:  # data of a continuous stream's next micro-batch
                self._chunk = chunk
                return _ROUND
            return chunk

    def _start_call(self, call: int) -> None:
        if call != self._call:
            self._call, self._call_done, self._call_stream = call, False, False
            self._micro_batch = None
            self._call_ended = set()
            self._epochs = {}
            self._plan = None

    def next_batch(self, batch_size: int) -> Batch:
        """Returns up to ``batch_size`` records; fewer (or none) only at the end.

        A batch never mixes two epochs (see :attr:`epoch`), so one that ends
        where the next chunk belongs to another epoch may hold fewer records.
        In inference mode a batch never spans two feeding tasks' chunks, so
        results can be routed back; it may then hold fewer records.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        parts: List[List[Any]] = []
        names: List[str] = []
        epoch: Optional[int] = None
        call: Optional[int] = None
        need = batch_size
        while need > 0 and not self._ended:
            chunk = self._chunk
            if chunk is None or chunk.pos >= chunk.rows:
                chunk = self._chunk = self._next_chunk()
                if chunk is None:
                    break
            take = min(need, chunk.rows - chunk.pos)
            if parts and chunk.epoch != epoch:
                break  # the next epoch starts a new batch
            if names and names != chunk.names:
                if not parts:
                    break
                raise ValueError(f"{self._node_name}: feed changed record layout from "
                                 f"{names} to {chunk.names} within one batch")
            names, epoch, call = chunk.names, chunk.epoch, chunk.item.call
            parts.append([c[chunk.pos:chunk.pos + take] for c in chunk.columns])
            chunk.pos += take
            need -= take
            if not self.train_mode:
                self._awaiting.append((chunk, take))
                break
        if not parts:
            return Batch([], [], 0)
        self.epoch, self._last_call = epoch, call
        if len(parts) == 1:
            columns = parts[0]
        else:
            columns = [np.concatenate(cols) if isinstance(cols[0], np.ndarray)
                       else [v for part in cols for v in part] for cols in zip(*parts)]
        return Batch(names, columns, batch_size - need)

    @property
    def ended(self) -> bool:
        """True once the feed itself has ended: the driver ended it (shutdown's
        END_FEED), the node was asked to stop, or it was terminated.  Unlike
        :meth:`should_stop`, the end of a ``train()`` call is not the feed's
        end: a later call's data may still come."""
        return self._ended or self._terminated

    @property
    def last_batch_call(self) -> Optional[int]:
        """The feed call (one ``train()`` or ``inference()`` of the driver) that
        the last batch ``next_batch`` returned came from; None before the first."""
        return self._last_call

    @property
    def awaiting_results(self) -> int:
        """How many batches returned in inference mode still await their
        :meth:`batch_results`."""
        return len(self._awaiting)

    def skip_results(self) -> None:
        """Declares that the last batch returned needs no results, so the next
        :meth:`batch_results` answers the batch before it.  For a layer that
        reads ``train()`` data (which wants none) through an inference-mode
        feed, as TensorFlowOnSpark's programs do (``ember.compat.tfos``).
        Raises RuntimeError when no batch awaits results."""
        if not self._awaiting:
            raise RuntimeError(f"{self._node_name}: skip_results() without a pending "
                               "inference batch")
        self._awaiting.pop()

    @property
    def epochs_done(self) -> Optional[int]:
        """How many epochs of the current ``train()`` call this node has read
        whole: the epochs before it had every one of their records returned by
        ``next_batch`` (each of this node's partitions of them has ended).  A
        trainer that checkpoints when this grows, saving it, resumes after a
        restart with ``ctx.resume_from(saved)``.  After a resumed feed it
        counts from the epoch resumed from; None before the call's first data.
        """
        if self._plan is None:
            return None
        per_epoch, first, end, nodes, routes, mine = self._plan
        e = first // per_epoch
        while e * per_epoch < end:
            lo, hi = max(first, e * per_epoch), min(end, (e + 1) * per_epoch)
            if any(p not in self._call_ended
                   for p in _routing.node_partitions(mine, lo, hi, nodes, routes)):
                break
            e += 1
        return e

    def stats(self) -> Dict[str, int]:
        """This node's feed counters since it started: batches, records and bytes
        received, partitions acknowledged, producers rejected, and
        ``shm_producers``, the feeding connections whose batches came through
        shared memory (the others came over TCP)."""
        return dict(self._server.stats())

    def should_stop(self) -> bool:
        """True once the data has ended and nothing is left to read.

        The data ends when the feed ends (shutdown), is terminated, or when
        every partition of the current ``train()`` call has been read: each
        feeding task marks its partition's end, and the node knows how many
        partitions the call routes to it.  So a trainer sees the end of its
        share of the data as soon as it has read it, however unevenly the
        partitions fall, and data of a later ``train()`` call starts a new
        round (``next_batch`` returns it; ``should_stop`` is False again)."""
        if self._terminated:
            return True
        if self._chunk is not None and self._chunk.pos < self._chunk.rows:
            return False
        return self._ended or self._call_done

    # -- streams ------------------------------------------------------------
    def micro_batches(self) -> Iterator[int]:
        """The ids of a stream's micro-batches (``Cluster.train_stream``), each
        yielded once its first data is here; ends when the feed ends
        (``cluster.shutdown()``) or the node is asked to stop.

        Read each micro-batch until :meth:`should_stop`, and checkpoint between
        them whenever it suits, saving :attr:`next_micro_batch`::

            feed = ctx.get_data_feed()
            ctx.resume_from(saved_next_micro_batch)  # from the checkpoint; 0 when fresh
            for micro_batch in feed.micro_batches():
                while not feed.should_stop():
                    train_on(feed.next_batch(64))
                if time_to_checkpoint():
                    save(model, next_micro_batch=feed.next_micro_batch)
                    ctx.checkpointed(feed.next_micro_batch)

        Every node gets a round for every micro-batch, possibly empty, in the
        same order, so a synchronous trainer's nodes meet in each.  Waits for
        the next micro-batch as long as the stream is quiet: a lost driver
        ends the node through its heartbeats."""
        while True:
            if self._micro_batch is not None and not self.should_stop():
                raise RuntimeError(
                    f"{self._node_name}: micro-batch {self._micro_batch} was not read to its "
                    "end (next_batch until should_stop()) before asking for the next one; "
                    "its remaining records would be lost")
            if self._ended or self._terminated:
                return
            if self._next_chunk(await_round=True) is not _ROUND:
                return
            if self._micro_batch is None:
                raise RuntimeError(f"{self._node_name}: feed call {self._call} is not a "
                                   "stream's micro-batch: micro_batches() reads only "
                                   "Cluster.train_stream's data")
            yield self._micro_batch

    @property
    def micro_batch(self) -> Optional[int]:
        """The stream micro-batch being read (None outside a stream)."""
        return self._micro_batch

    @property
    def mid_micro_batch(self) -> bool:
        """True while a micro-batch is begun but not read whole: a checkpoint
        taken now would hold part of it (the feed ended or the query was
        stopped in its middle), so skip it."""
        return self._micro_batch is not None and self._read_through != self._micro_batch

    @property
    def next_micro_batch(self) -> Optional[int]:
        """The first micro-batch of the stream this node has not read whole: what
        a checkpoint records, and what ``ctx.resume_from`` names after a
        restart.  None before any micro-batch (then: the one resumed from)."""
        if self._read_through is not None:
            return self._read_through + 1
        return self._skip_before

    # -- results ------------------------------------------------------------
    def batch_results(self, results: Any) -> None:
        """Returns one result per record of the oldest batch still awaiting results."""
        if not self._awaiting:
            raise RuntimeError(f"{self._node_name}: batch_results() without a pending "
                               "inference batch (is the feed in train_mode?)")
        chunk, given = self._awaiting.popleft()
        count = len(results)
        if count != given:
            raise ValueError(f"{self._node_name}: batch_results got {count} results for a "
                             f"batch of {given} records")
        chunk.results.append(results)
        chunk.answered += given
        if chunk.answered == chunk.rows:
            self._flush(chunk)

    def _flush(self, chunk: _Chunk) -> None:
        parts, chunk.results = chunk.results, []
        if all(isinstance(p, np.ndarray) for p in parts):
            merged: Any = np.concatenate(parts) if len(parts) > 1 else parts[0]
        else:
            merged = [r for p in parts for r in (p.tolist() if isinstance(p, np.ndarray) else p)]
        cols, n = _columns.records_to_columns(merged, where=f"{self._node_name} results")
        self._server.send_results(chunk.source, cols, n, self._feed_timeout)

    def terminate(self) -> None:
        """Stops consuming: feeding tasks finish at once and their data is dropped."""
        self._terminated = True
        self._chunk = None
        self._server.terminate()


@dataclass
class NodeContext:
    """What a node knows about itself and the cluster (TensorFlowOnSpark's ``ctx``)."""

    executor_id: int
    worker_num: int
    job_name: str
    task_index: int
    cluster_spec: Dict[str, List[str]]
    num_workers: int
    host: str
    ports: List[int]
    input_mode: int
    defaultFS: str = "file://"
    working_dir: str = field(default_factory=os.getcwd)
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    #: the GPU addresses Spark assigned to this node's task (``run(gpus_per_node=)``);
    #: CUDA_VISIBLE_DEVICES lists the same, so TensorFlow/torch see these only
    gpus: List[str] = field(default_factory=list)
    _feed_server: Any = None
    _control: Any = None
    _reserved_fds: List[int] = field(default_factory=list)
    _feed: Optional[DataFeed] = None
    _collective: Any = None  # ember.collective.Collective on chief/worker nodes
    _resume_told: bool = False  # resume_from() called, or the feed read first
    _resume_point: Optional[int] = None  # what resume_from() named
    _secret: bytes = b""  # the job secret (authenticates the parameter servers' clients)
    _encrypt: bool = False  # run(encrypt=...)
    _ps_client: Any = None  # ember.ps.Client, once parameter_servers() was called
    _feed_reader: Any = None  # ember._ember.FeedReader of ember.tf.feed_dataset

    @property
    def framework_port(self) -> int:
        """The port reserved for the framework's server (TF gRPC, torch MASTER_PORT)."""
        return self.ports[0]

    @property
    def feed_server(self) -> Any:
        """This node's feed server (an ``ember._ember.FeedServer``: ``next``,
        ``send_results``, ``terminate``), or None on a node that is not fed
        (only the chief and workers of an InputMode.SPARK cluster are).

        A trainer reads its feed with :meth:`get_data_feed`; this is for a
        layer that routes the feed itself and reads it through
        :meth:`data_feed` (``ember.compat.tfos`` splits it into
        TensorFlowOnSpark's named queues)."""
        return self._feed_server

    def stop_requested(self) -> bool:
        """True once the driver has asked this node to stop (``shutdown``, or a
        failure elsewhere): its main_fun should return."""
        return self._control is not None and self._control.stop_state() != 0

    def get_data_feed(self, train_mode: bool = True, qname_in: str = "input",
                      qname_out: str = "output", input_mapping: Any = None,
                      feed_timeout: float = 600.0,
                      on_producer_error: str = "wait") -> DataFeed:
        """The feed of this node (InputMode.SPARK on chief/worker nodes only);
        ``on_producer_error``: see :class:`DataFeed`."""
        if self._feed_server is None:
            raise RuntimeError(
                f"{self.job_name}:{self.task_index} has no data feed: only chief and "
                "worker nodes of an InputMode.SPARK cluster are fed")
        if self._feed_reader is not None:
            raise RuntimeError("this node's feed is already read by ember.tf.feed_dataset; "
                               "a DataFeed would get only part of its rows: use one or the other")
        if self._feed is None or self._feed.train_mode != train_mode:
            self._feed = self.data_feed(self._feed_server, train_mode, feed_timeout,
                                        on_producer_error=on_producer_error)
        return self._feed

    def data_feed(self, source: Any, train_mode: bool = True, feed_timeout: float = 600.0,
                  name: Optional[str] = None, on_producer_error: str = "wait") -> DataFeed:
        """A new :class:`DataFeed` of this node over ``source``: :attr:`feed_server`,
        or an object with its ``next(timeout)``, ``send_results`` and
        ``terminate`` (one queue of a layer that routes the feed).

        The feed stops when :meth:`stop_requested`, and its first read tells
        the driver, unless :meth:`resume_from` did first, that this node
        resumes from epoch 0 (see ``Cluster.train``).

        :param train_mode: False for inference (answer with ``batch_results``).
        :param feed_timeout: seconds ``next_batch`` waits for data before it raises.
        :param name: how messages name the feed (default ``node <index> (<role>:<task>)``).
        :param on_producer_error: see :class:`DataFeed`.
        """
        stop = self.stop_requested if self._control is not None else None
        name = name or f"node {self.worker_num} ({self.job_name}:{self.task_index})"
        feed = DataFeed(source, train_mode, feed_timeout, stop, name, on_producer_error,
                        skip_before=self._resume_point)
        if not self._resume_told:
            feed._on_first_read = lambda: self._tell_resume("")
        return feed

    def resume_from(self, epoch: int) -> None:
        """Tells the driver which epoch this node resumes from (after a restart:
        the first epoch its checkpoint does not cover), before it reads its feed.

        When ``max_restarts`` restarts the cluster during ``train(data,
        num_epochs)``, the driver waits until every chief/worker node has named
        its epoch this way or has started reading its feed (which counts as
        epoch 0), then feeds epochs ``e..num_epochs-1`` of that call whole,
        ``e`` being the smallest epoch named; epochs before ``e`` are not fed
        again.  Epochs count from 0 within the interrupted ``train()`` call;
        :attr:`DataFeed.epoch` labels the batches the same way, so a trainer
        that checkpoints whenever :attr:`DataFeed.epochs_done` grows (saving
        it) and resumes with ``ctx.resume_from(saved)`` trains every record
        once per epoch, except the records of epochs ``e`` and later that it
        trained before the failure.  Only a restart during ``train()`` uses
        it: the first run of a call is always fed whole.

        In a stream (``Cluster.train_stream``) it names a micro-batch: the
        first one this node's checkpoint does not hold (the saved
        :attr:`DataFeed.next_micro_batch`; 0 when starting fresh).  Whenever
        nodes start, first or after a restart, the driver feeds the stream
        from the smallest micro-batch they name (from its feed log, for those
        Spark has already committed), and each node drops the micro-batches
        before the one it named: every record is trained exactly once.  A
        node that reads its stream without naming one gets the micro-batches
        from the query's next one on.
        """
        try:
            if isinstance(epoch, bool):
                raise TypeError
            epoch = operator.index(epoch)
        except TypeError:
            raise ValueError(f"resume_from: epoch must be an int >= 0, got {epoch!r}") from None
        if epoch < 0:
            raise ValueError(f"resume_from: epoch must be an int >= 0, got {epoch}")
        if self._resume_told:
            logger.warning(f"node {self.worker_num} ({self.job_name}:{self.task_index}): "
                           f"resume_from({epoch}) comes after the feed was read (or a first "
                           "resume_from): ignored; call it before reading")
            return
        self._resume_point = epoch
        if self._feed is not None:
            self._feed._skip_before = epoch
        self._tell_resume(str(epoch))

    def checkpointed(self, next_micro_batch: int) -> None:
        """Tells the driver that this node's latest checkpoint holds every
        micro-batch of its stream before ``next_micro_batch``
        (:attr:`DataFeed.next_micro_batch` when it was saved), so the stream's
        feed log may drop them once every fed node has said so.  Without it
        the log keeps every micro-batch for a restart to replay."""
        if isinstance(next_micro_batch, bool) or not isinstance(next_micro_batch, int) or \
                next_micro_batch < 0:
            raise ValueError(f"checkpointed: next_micro_batch must be an int >= 0, got "
                             f"{next_micro_batch!r}")
        if self._control is not None:
            try:
                self._control.report("progress", CHECKPOINT_REPORT, str(next_micro_batch), 10.0)
            except _ember.EmberError:
                pass  # the driver is gone: this node is ending anyway

    def _tell_resume(self, text: str) -> None:
        if self._resume_told:
            return
        self._resume_told = True
        if self._control is not None:
            try:
                self._control.report("progress", RESUME_REPORT, text, 10.0)
            except _ember.EmberError:
                pass  # the driver is gone: this node is ending anyway

    def absolute_path(self, path: str) -> str:
        """A fully qualified URI for ``path`` (TensorFlowOnSpark's rules): URIs
        pass through; with an HDFS default file system (``defaultFS``, else
        ``fs.defaultFS`` of ``$HADOOP_CONF_DIR``) an absolute path goes under
        it and a relative one under ``/user/<user>``; otherwise paths are
        qualified against the working dir as ``file://``."""
        if "://" in path:
            return path
        from ember import hdfs

        fs = self.defaultFS if self.defaultFS and self.defaultFS != "file://" \
            else hdfs.default_fs()
        if fs.startswith(("hdfs://", "viewfs://", "webhdfs://", "swebhdfs://")):
            fs = fs.rstrip("/")
            if path.startswith("/"):
                return fs + path
            import getpass

            user = os.environ.get("HADOOP_USER_NAME") or getpass.getuser()
            return f"{fs}/user/{user}/{path}"
        return "file://" + os.path.abspath(os.path.join(self.working_dir, path))

    # -- MLflow (ember.mlflow) ---------------------------------------------------
    @property
    def is_chief(self) -> bool:
        """The chief, or worker 0 in a cluster without one."""
        if "chief" in self.cluster_spec:
            return self.job_name == "chief"
        return self.job_name == "worker" and self.task_index == 0

    @property
    def mlflow_run_id(self) -> Optional[str]:
        """The job's MLflow run id (None when the job is not tracked): log into it
        from any node with ``mlflow.tracking.MlflowClient().log_*(ctx.mlflow_run_id, ...)``."""
        from ember import mlflow as _mlflow

        return _mlflow.node_run_id()

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """Logs ``metrics`` (name -> number) at ``step`` (the epoch, say) into the
        job's MLflow run, from the chief (worker 0 without one); a no-op on other
        nodes and when the job is not tracked (no ``MLFLOW_TRACKING_URI`` on the
        driver), so every node may call it."""
        if self.is_chief:
            from ember import mlflow as _mlflow

            _mlflow.node_log_metrics(metrics, step)

    def log_artifacts(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        """Uploads a file or directory of this node (the exported model, say) into
        the job's MLflow run under ``artifact_path``, from the chief only (as
        :meth:`log_metrics`)."""
        if self.is_chief:
            from ember import mlflow as _mlflow

            _mlflow.node_log_artifacts(local_path, artifact_path)

    def report_progress(self, text: str) -> None:
        """Sends a progress line to the driver, which prints it with the node's name."""
        if self._control is not None:
            self._control.report("progress", 0, text, 10.0)

    # -- collectives (ember.collective) -----------------------------------------
    @property
    def collective(self) -> Any:
        """This node's :class:`ember.collective.Collective` (``.rank``, ``.size``):
        the chief and workers, in ``RANK`` order, over a port reserved at start."""
        if self._collective is None:
            raise RuntimeError(f"{self.job_name}:{self.task_index} takes no part in "
                               "collectives: only chief and worker nodes do")
        return self._collective

    def allreduce(self, array: Any, op: str = "sum", timeout: Optional[float] = None) -> Any:
        """Reduces a numpy array over all chief/worker nodes, in place
        (``op``: "sum", "avg" or "mean", "min", "max"); see :mod:`ember.collective`."""
        return self.collective.allreduce(array, op, timeout)

    def broadcast(self, array: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        """Copies rank ``root``'s numpy array into ``array`` on every node, in place."""
        return self.collective.broadcast(array, root, timeout)

    def allgather(self, array: Any, timeout: Optional[float] = None) -> Any:
        """Every node's ``array`` stacked in rank order: shape ``(size, *array.shape)``."""
        return self.collective.allgather(array, timeout)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every chief/worker node has entered the barrier."""
        self.collective.barrier(timeout)

    def serve_until_stopped(self, poll: float = 0.2) -> None:
        """Tells the driver this node serves (a framework's server runs in
        it, such as ``tf.distribute.Server`` on a worker of TensorFlow's
        ParameterServerStrategy, whose work the chief schedules) and returns
        when the driver stops it: ``cluster.shutdown()`` waits for the
        trainers that do not serve (the chief), then stops the rest."""
        self._control.report("progress", SERVING_REPORT, "", 10.0)
        while self._control.stop_state() == 0:
            time.sleep(poll)

    def parameter_servers(self, timeout: float = 600.0) -> Any:
        """This worker's :class:`ember.ps.Client` to the cluster's parameter
        servers (``run(..., num_ps=k, parameter_servers=ParameterServers())``),
        connected on the first call and the same object after.  When
        ``main_fun`` returns, Ember tells the servers this worker finished
        (so bounded staleness holds nobody back for it) and closes it.

        :param timeout: seconds each call may take (a pull that waits for a
            slower worker included) before it raises, naming the worker."""
        if self._ps_client is None:
            from ember import ps

            me = next(n for n in self.nodes if n["index"] == self.worker_num)
            self._ps_client = ps.connect(self.nodes, me, self._secret, self._encrypt, timeout)
        return self._ps_client

    def release_port(self) -> None:
        """Closes Ember's hold on the framework port.

        Not needed with TensorFlow or gRPC: Ember holds the port with
        SO_REUSEPORT bound but not listening, so the framework can bind it at
        any time with no window in which a third process could take it."""
        while self._reserved_fds:
            os.close(self._reserved_fds.pop())
