"""A node's feed as a native ``tf.data`` dataset.

``feed_dataset(ctx, batch_size)`` yields the rows Spark pushes into this node
(``cluster.train``) as batches of tensors.  The batches are made by a
TensorFlow op written in C against TensorFlow's C kernel API
(``_tf_feed_op.c``, loaded with ``tf.load_op_library``): it runs in
TensorFlow's own threads, copies each row once, from the feed's received
batch straight into the tensor, and calls no Python per batch.  So the
trainer's step never waits on the GIL for its data, and the dataset works
wherever a ``tf.data`` pipeline does: ``model.fit`` (Keras 3 and tf_keras),
custom loops, ``prefetch``, and a ParameterServerStrategy ``dataset_fn`` on a
worker, where ``from_generator`` cannot run (tensorflow#48957).

Iterating the dataset reads one ``cluster.train()`` call to its end; iterating
it again reads the next call.  Batches span partitions and epochs (as
``unbatch().batch(n)`` would); give Keras ``steps_per_epoch`` to count epochs,
as TensorFlowOnSpark's users did.  A batch is ``batch_size`` rows, fewer only
where the call's data ends.

The dataset and ``ctx.get_data_feed()`` must not read one node's feed at
once: each would get part of the rows.

``allreduce(tensor, ctx)`` sums (or averages, ...) a tensor over the node's
collective inside the graph, with a second op in C (``_tf_allreduce_op.c``):
a ``tf.function`` training step computes, reduces and applies its gradients
in one call, where ``ctx.allreduce`` on numpy arrays needs the step cut in
two around it.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ember import _columns, _ember
from ember.errors import EmberError, EmberFeedError

logger = logging.getLogger("ember.tf")

_op_lock = threading.Lock()
_op_module: Any = None
_attach: Any = None  # the library's ember_tf_attach


def _ops() -> Any:
    """The op library, loaded once per process."""
    global _op_module, _attach
    with _op_lock:
        if _op_module is None:
            import tensorflow as tf

            here = os.path.dirname(os.path.abspath(__file__))
            found = sorted(glob.glob(os.path.join(here, "_ember_tf*.so")))
            if not found:
                raise EmberError(
                    "ember.tf.feed_dataset needs Ember's TensorFlow op, which is built when "
                    "Ember is installed into an environment that has TensorFlow; this one "
                    f"was built without it ({here} has no _ember_tf*.so): install "
                    "tensorflow, then reinstall ember (pip install --no-build-isolation .)")
            module = tf.load_op_library(found[0])
            # the op reaches this process's readers through libember's table
            # (the .so is loaded already: CDLL only looks it up)
            library = ctypes.CDLL(found[0])
            attach = library.ember_tf_attach
            attach.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            attach_collective = library.ember_tf_attach_collective
            attach_collective.argtypes = [ctypes.c_void_p]
            if attach(_ember.FEED_READER_API, 0) != 0 or \
                    attach_collective(_ember.COLLECTIVE_API) != 0:
                raise EmberError(f"{found[0]} and ember._ember are from different builds: "
                                 "reinstall ember")
            _op_module, _attach = module, attach
        return _op_module


def attach(ctx: Any, fail_on_producer_error: bool = False) -> None:
    """Makes this node's feed the one that datasets built elsewhere read.

    A ParameterServerStrategy coordinator traces a worker's ``dataset_fn``
    in its own process and runs it on the worker; the op there (attr
    ``reader=0``) reads the feed of the node whose process runs it.  Called
    by ``ember.ps.tensorflow_server`` on fed nodes."""
    _ops()
    reader = _reader(ctx, fail_on_producer_error)
    _attach(_ember.FEED_READER_API, reader.id)


def _dtypes() -> Dict[int, Any]:
    """Feed column dtype -> TensorFlow dtype (the numpy types the feed's
    columns arrive as elsewhere, _columns.DT_TO_NUMPY; bytes as strings)."""
    import tensorflow as tf

    types = {dt: tf.as_dtype(np_type) for dt, np_type in _columns.DT_TO_NUMPY.items()}
    types[_ember.DT_BYTES] = tf.string
    return types


def _reader(source: Any, fail_on_producer_error: bool) -> Any:
    """The FeedReader of a NodeContext (one per node, closed when its main_fun
    ends) or of a bare FeedServer (the caller's to close)."""
    if isinstance(source, _ember.FeedServer):
        return _ember.FeedReader(source, fail_on_producer_error=fail_on_producer_error)
    server = getattr(source, "feed_server", None)
    if server is None:
        raise RuntimeError(
            f"{getattr(source, 'job_name', '?')}:{getattr(source, 'task_index', '?')} has no "
            "data feed: only chief and worker nodes of an InputMode.SPARK cluster are fed")
    if source._feed is not None:
        raise RuntimeError("this node's feed is already read through ctx.get_data_feed(); a "
                           "feed_dataset would get only part of its rows: use one or the other")
    reader = source._feed_reader
    if reader is None:
        reader = source._feed_reader = _ember.FeedReader(
            server, fail_on_producer_error=fail_on_producer_error)
        source._tell_resume("")  # reading starts here (see NodeContext.resume_from)
        if source._control is not None:
            threading.Thread(target=_end_on_stop, args=(source, server, reader),
                             name="ember-feed-stop", daemon=True).start()
    return reader


def _end_on_stop(ctx: Any, server: Any, reader: Any) -> None:
    """Ends the dataset when the driver asks this node to stop (shutdown, or a
    failure elsewhere), as DataFeed ends its reads: the server's terminate
    turns the feed's rest into its end."""
    import time

    while ctx._feed_reader is reader:
        if ctx.stop_requested():
            logger.info("the driver asked this node to stop: ending its feed dataset")
            try:
                server.terminate()
            except ValueError:
                pass  # closed meanwhile: the node is ending anyway
            return
        time.sleep(0.5)


def feed_dataset(source: Any, batch_size: int, *, element_spec: Any = None,
                 feed_timeout: float = 600.0, as_dict: bool = False,
                 fail_on_producer_error: bool = False) -> Any:
    """This node's feed as a ``tf.data.Dataset`` of batches.

    :param source: the node's context (``main_fun``'s ``ctx``), a bare
        ``ember._ember.FeedServer``, or None: the feed of the node whose
        process runs the dataset (a ParameterServerStrategy ``dataset_fn``,
        traced on the coordinator and run on each worker, whose
        ``ember.ps.tensorflow_server(ctx)`` attached its feed); then
        ``element_spec`` is required.
    :param batch_size: rows per batch (fewer only where the data ends).
    :param element_spec: the columns' ``tf.TensorSpec`` (a tuple of them, in
        the records' field order, or one), each ``[None, *row shape]``.  By
        default the dataset's creation waits for the first rows and reads
        their types and shapes.
    :param feed_timeout: seconds to wait for rows before failing with
        DeadlineExceeded.
    :param as_dict: elements as ``{field: tensor}`` instead of a tuple of the
        columns in the records' field order (a single column: the tensor).
    :param fail_on_producer_error: a feeding task's failure fails the
        dataset; by default it is logged, and Spark's retry of the task sends
        the rest of its rows.
    :returns: a dataset whose elements are the batches; a column of scalars
        is ``[n]``, of vectors ``[n, width]``, of shaped rows ``[n, *shape]``,
        of bytes or str ``tf.string [n]``.
    """
    import tensorflow as tf

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    ops = _ops()
    if source is None and element_spec is None:
        raise ValueError("feed_dataset(None, ...) reads the feed of whichever node runs it, "
                         "so it cannot look at the rows first: pass element_spec")
    # one reader: the rows it looks at first stay held for the op
    reader = None if source is None else _reader(source, fail_on_producer_error)
    if element_spec is not None:
        fields, dtypes, widths, shapes = _declared(element_spec)
    else:
        fields, dtypes, widths, shapes = _first_rows_layout(reader, feed_timeout)
    reader_id = 0 if reader is None else reader.id
    timeout_ms = -1 if feed_timeout is None else int(feed_timeout * 1000)

    def next_batch(_: Any) -> Any:
        more, columns = ops.ember_feed_next(reader=reader_id, batch_size=batch_size,
                                            dtypes=dtypes, widths=widths,
                                            timeout_ms=timeout_ms)
        shaped = tuple(tf.reshape(c, (-1,) + s) for c, s in zip(columns, shapes))
        return more, shaped

    def element(_more: Any, columns: Tuple[Any, ...]) -> Any:
        if as_dict:
            return dict(zip(fields, columns))
        return columns[0] if len(columns) == 1 else columns

    ds = tf.data.Dataset.from_tensors(0).repeat().map(next_batch)
    ds = ds.take_while(lambda more, _columns: more).map(element)
    # the reader lives as long as any dataset made from it
    ds._ember_feed_reader = reader
    return ds


Layout = Tuple[List[str], List[Any], List[int], List[Tuple[int, ...]]]


def _first_rows_layout(reader: Any, feed_timeout: float) -> Layout:
    """The columns of the feed's first rows (waiting for them)."""
    rows = reader.wait(1, feed_timeout)
    if rows is None:
        raise TimeoutError(f"no data arrived on the feed for {feed_timeout:.0f} s "
                           "(feed_timeout); is cluster.train() running?")
    if rows == 0:
        raise EmberFeedError("the feed call ended before any row arrived: there is nothing "
                             "to make a dataset of (an empty DataFrame or RDD?)")
    tf_types = _dtypes()
    fields: List[str] = []
    dtypes: List[Any] = []
    widths: List[int] = []
    shapes: List[Tuple[int, ...]] = []
    for name, dtype, width in reader.layout():
        field, shape, _is_str = _columns.decode_name(name)
        fields.append(field)
        dtypes.append(tf_types[dtype])
        widths.append(width)
        shapes.append(() if dtype == _ember.DT_BYTES else _columns.row_shape(shape, width))
    return fields, dtypes, widths, shapes


def _declared(element_spec: Any) -> Layout:
    """The columns an element_spec declares."""
    import tensorflow as tf

    specs = element_spec if isinstance(element_spec, (tuple, list)) else (element_spec,)
    fields, dtypes, widths, shapes = [], [], [], []
    for i, spec in enumerate(specs):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None or \
                spec.shape.rank < 1 or None in spec.shape.as_list()[1:]:
            raise ValueError(f"element_spec[{i}] must be a tf.TensorSpec([None, *row shape], "
                             f"dtype) with a known row shape, not {spec!r}")
        if spec.dtype not in _dtypes().values():
            raise ValueError(f"element_spec[{i}]: the feed carries float32, float64, int32, "
                             f"int64, uint8, bool and string columns, not {spec.dtype.name}")
        row = tuple(spec.shape.as_list()[1:])
        fields.append(spec.name or str(i))
        dtypes.append(spec.dtype)
        widths.append(0 if spec.dtype == tf.string else int(np.prod(row, dtype=np.int64)))
        shapes.append(() if spec.dtype == tf.string else row)
    return fields, dtypes, widths, shapes


_REDUCTIONS = {"sum": "sum", "avg": "avg", "mean": "avg", "min": "min", "max": "max"}


def allreduce(tensor: Any, source: Any, op: str = "sum", timeout: Optional[float] = None) -> Any:
    """``tensor`` reduced elementwise over the ranks of a node's collective,
    as a TensorFlow op: usable inside ``tf.function`` (and eagerly).

    The chief and worker nodes are the ranks (:mod:`ember.collective`); every
    rank must run the same reductions in the same order, as with
    ``ctx.allreduce``.  Inside one ``tf.function`` the op runs in program
    order with the function's other stateful ops.  A dead or silent peer
    fails the step (``tf.errors.AbortedError``, or ``DeadlineExceededError``
    after ``timeout``) with libember's message naming the rank; the
    collective is then broken for good, as after a failed ``ctx.allreduce``.

    :param tensor: float32, float64, int32 or int64, any shape, the same on
        every rank.
    :param source: the node's context (``main_fun``'s ``ctx``) or an
        :class:`ember.collective.Collective`.
    :param op: ``"sum"``, ``"avg"`` (alias ``"mean"``), ``"min"`` or ``"max"``.
    :param timeout: seconds; None for the collective's own (``ctx.collective.timeout``).
    :returns: a tensor of ``tensor``'s shape and dtype, bit-identical on
        every rank.
    """
    import tensorflow as tf

    from ember.collective import collective_of

    if not isinstance(op, str) or op not in _REDUCTIONS:
        raise ValueError(f"op must be one of {sorted(_REDUCTIONS)}, not {op!r}")
    coll = collective_of(source)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype not in (tf.float32, tf.float64, tf.int32, tf.int64):
        raise TypeError(f"allreduce takes float32, float64, int32 or int64 tensors, not "
                        f"{tensor.dtype.name}")
    seconds = coll.timeout if timeout is None else float(timeout)
    # the communicator connects on first use (every rank reaches this while
    # tracing the same step), so its id is known when the op is made
    return _ops().ember_allreduce(tensor, comm=coll.communicator().id, op=_REDUCTIONS[op],
                                  timeout_ms=-1 if seconds < 0 else int(seconds * 1000))
