"""The inference side of :class:`ember.ml.EmberModel`: model loading, the
per-Python-worker model cache, and Arrow <-> numpy conversion.

Nothing here imports pyspark: the functions run in Spark's Python workers
(``mapInArrow``) and on the driver (to inspect a model before any task runs);
in a task, :func:`ember._gpu.bind_task_gpus` reads the task's GPUs from
pyspark's TaskContext before the model loads.

A SavedModel is run as one pruned graph function: the input and output
tensors (named by signature alias, or by graph tensor name when no signature
is used) are resolved to graph tensors, and
``tensorflow.python.saved_model.load_v1_in_v2`` prunes the graph to exactly
those feeds and fetches (outputs nobody asked for are not computed).  The same
loader reads TF1 and TF2 SavedModels.

ExportDir and ModelDir may be ``hdfs://`` / ``webhdfs://`` URLs: every reader
here opens the local copy :mod:`ember.ml._model_files` gives (one per host
and model version), while the spec and the messages keep the URL.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import (TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from ember import hdfs
from ember._imports import collector_paused
from ember.errors import ModelInputError
from ember.ml import _model_files

if TYPE_CHECKING:
    from ember.ml._torch import TorchPredictor

#: (export_dir, signature key, tags, inputs, outputs, stamp) -> _Predictor (or
#: TorchPredictor); one per Python worker process, reused by every task that
#: worker runs.
_CACHE: Dict[Tuple[Any, ...], Union["_Predictor", "TorchPredictor"]] = {}
_CACHE_LOCK = threading.RLock()  # checkpoint_export runs inside predictor()
#: model source (export or checkpoint dir) -> times this process loaded it;
#: tests read it through a task (a reused worker keeps earlier tests' models)
_LOADS: Dict[str, int] = {}

logger = logging.getLogger("ember.ml")

_THREADS_SET = False


def _import_tf() -> Any:
    global _THREADS_SET
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if not _THREADS_SET:
        _THREADS_SET = True
        tf.get_logger().setLevel("ERROR")
        _limit_threads(tf)
    return tf


def _limit_threads(tf: Any) -> None:
    """In a Spark Python worker, TensorFlow's thread pools get the task's cores.

    Spark runs ``spark.task.cpus`` cores' worth of tasks per executor core and
    tells each Python worker its share in ``OMP_NUM_THREADS`` (set to
    spark.task.cpus unless the user set it); TensorFlow ignores that variable
    and sizes its intra-op pool to every core of the machine, so concurrent
    tasks each run a pool that wide, competing with each other and with the
    JVM threads that feed them (measured: fewer rows/s on local[2]).
    ``EMBER_TF_THREADS`` overrides; 0 leaves TensorFlow's defaults.  The
    driver (no OMP_NUM_THREADS) is left alone."""
    want = os.environ.get("EMBER_TF_THREADS") or (
        os.environ.get("OMP_NUM_THREADS") if "PYTHON_WORKER_FACTORY_SECRET" in os.environ
        else None)
    try:
        n = int(want) if want else 0
    except ValueError:
        return
    if n <= 0:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)
    except RuntimeError:  # TensorFlow already ran something in this process
        pass


def _tensor_name(name: str) -> str:
    return name if ":" in name else name + ":0"


def saved_model_stamp(export_dir: str) -> int:
    """The SavedModel's stamp (saved_model.pb's modification time in ns; on HDFS,
    a stamp of its version): a re-exported model is reloaded."""
    return _model_files.saved_model(export_dir)[1]


def _meta_graph(export_dir: str, tags: Optional[Sequence[str]]) -> Any:
    """The MetaGraphDef of ``tags`` (read from saved_model.pb, no variables loaded)."""
    _import_tf()
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    local = _model_files.saved_model(export_dir)[0]
    with open(os.path.join(local, _model_files.SAVED_MODEL_PB), "rb") as f:
        sm.ParseFromString(f.read())
    if not tags:
        if len(sm.meta_graphs) != 1:
            raise ModelInputError(f"{export_dir} has {len(sm.meta_graphs)} MetaGraphs; set "
                                  "TagSet to choose one")
        return sm.meta_graphs[0]
    want = set(tags)
    for mg in sm.meta_graphs:
        if set(mg.meta_info_def.tags) == want:
            return mg
    have = [",".join(mg.meta_info_def.tags) for mg in sm.meta_graphs]
    raise ModelInputError(f"{export_dir} has no MetaGraph with TagSet {','.join(tags)!r} "
                          f"(it has: {have})")


class TensorInfo:
    """dtype (numpy) and shape (None for an unknown dimension) of one model tensor."""

    __slots__ = ("key", "tensor", "dtype", "shape")

    def __init__(self, key: str, tensor: str, dtype: Any, shape: Optional[Tuple[Any, ...]]) -> None:
        self.key, self.tensor, self.dtype, self.shape = key, tensor, dtype, shape

    def describe(self) -> str:
        shape = "?" if self.shape is None else \
            "[" + ", ".join("None" if d is None else str(d) for d in self.shape) + "]"
        return f"{self.dtype} {shape}"


def resolve(export_dir: str, signature: Optional[str], tags: Optional[Sequence[str]],
            inputs: Sequence[str], outputs: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Graph tensor names of the model inputs/outputs named in the mappings.

    With a signature, names are the signature's input/output aliases; without,
    they are graph tensor names (``"x"`` means ``"x:0"``).  Raises
    :class:`ModelInputError` naming the signature key or the tensor that does
    not exist, and what does."""
    mg = _meta_graph(export_dir, tags)
    if signature:
        if signature not in mg.signature_def:
            raise ModelInputError(f"SignatureDefKey {signature!r} is not in {export_dir} "
                                  f"(signatures: {sorted(k for k in mg.signature_def if not k.startswith('__'))})")
        sig = mg.signature_def[signature]
        for names, table, what in ((inputs, sig.inputs, "input"), (outputs, sig.outputs, "output")):
            for n in names:
                if n not in table:
                    raise ModelInputError(f"signature {signature!r} has no {what} {n!r} "
                                          f"({what}s: {sorted(table)})")
        return [sig.inputs[n].name for n in inputs], [sig.outputs[n].name for n in outputs]
    nodes = {n.name for n in mg.graph_def.node}
    for n in list(inputs) + list(outputs):
        if _tensor_name(n).rsplit(":", 1)[0] not in nodes:
            placeholders = sorted(x.name for x in mg.graph_def.node if x.op == "Placeholder")
            raise ModelInputError(f"tensor {n!r} is not in the graph of {export_dir} "
                                  f"(SignatureDefKey is unset, so mappings name graph tensors; "
                                  f"its placeholders: {placeholders[:20]})")
    return [_tensor_name(n) for n in inputs], [_tensor_name(n) for n in outputs]


class _Predictor:
    """A loaded, pruned SavedModel: ``run(list of numpy inputs) -> list of numpy outputs``."""

    def __init__(self, export_dir: str, tags: Optional[Sequence[str]], feeds: List[str],
                 fetches: List[str], keys_in: Sequence[str], keys_out: Sequence[str]) -> None:
        tf = _import_tf()
        from tensorflow.python.saved_model import load_v1_in_v2

        self.tf = tf
        local, self.stamp = _model_files.saved_model(export_dir)
        self._loaded = load_v1_in_v2.load(local, list(tags) if tags else None)
        try:
            self.fn = self._loaded.prune(feeds, fetches)
        except (KeyError, ValueError) as exc:
            raise ModelInputError(f"cannot run {export_dir} from {feeds} to {fetches}: {exc}") from exc
        self.inputs = [TensorInfo(k, t.name, np.dtype(t.dtype.as_numpy_dtype),
                                  None if t.shape.rank is None else tuple(t.shape.as_list()))
                       for k, t in zip(keys_in, self.fn.inputs)]
        outs = self.fn.outputs
        self.outputs = [TensorInfo(k, t.name, np.dtype(t.dtype.as_numpy_dtype),
                                   None if t.shape.rank is None else tuple(t.shape.as_list()))
                        for k, t in zip(keys_out, outs)]
        if any(o.shape is None for o in self.outputs):
            self._probe_output_shapes()

    def _probe_output_shapes(self) -> None:
        """Output ranks the graph does not record (a TF2 function call's outputs
        in the imported graph): one call on a one-row batch of zeros."""
        xs = []
        for i in self.inputs:
            if i.shape is None or any(d is None for d in i.shape[1:]):
                return  # unknown; arrow_type() reports the output it cannot type
            xs.append(np.zeros((1, *i.shape[1:]), dtype=i.dtype))
        for o, y in zip(self.outputs, self.run(xs)):
            if o.shape is None:
                o.shape = (None, *y.shape[1:]) if y.ndim else ()

    def run(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        out = self.fn(*[self.tf.convert_to_tensor(a) for a in arrays])
        if not isinstance(out, (list, tuple)):
            out = [out]
        return [o.numpy() for o in out]


def _cache_key(spec: Dict[str, Any]) -> Tuple[Any, ...]:
    return (spec.get("format", "savedmodel"), spec.get("checkpoint") or spec["export_dir"],
            spec.get("signature"), tuple(spec.get("tags") or ()), tuple(spec["feeds"]),
            tuple(spec["fetches"]), spec["stamp"])


def forget(spec: Dict[str, Any]) -> None:
    """Drops this process's predictor of ``spec`` (an inference worker handed
    another model holds one model at a time)."""
    with _CACHE_LOCK:
        _CACHE.pop(_cache_key(spec), None)


def _load(spec: Dict[str, Any]) -> Any:
    if spec.get("format") == "torchscript":
        from ember.ml._torch import TorchPredictor

        return TorchPredictor(spec)
    export = checkpoint_export(spec["checkpoint"])[0] if spec.get("checkpoint") \
        else spec["export_dir"]
    p = _Predictor(export, spec["tags"], spec["feeds"], spec["fetches"],
                   spec["input_keys"], spec["output_keys"])
    if not spec.get("checkpoint") and p.stamp != spec["stamp"]:
        logger.warning(f"ExportDir {export} changed after transform() checked it "
                       "on the driver; running the version found now")
    return p


def predictor(spec: Dict[str, Any]) -> Any:
    """The cached predictor of ``spec`` in this process (loaded on first use): a
    SavedModel's, or a TorchScript module's (``spec['format'] == 'torchscript'``,
    :class:`ember.ml._torch.TorchPredictor`); both have ``inputs``,
    ``outputs`` and ``run``."""
    # executors without HADOOP_CONF_DIR take the driver's, where it exists on their host
    hdfs.ensure_conf_dir(spec.get("hadoop_conf_dir"))
    source = spec.get("checkpoint") or spec["export_dir"]
    key = _cache_key(spec)
    with _CACHE_LOCK:
        p = _CACHE.get(key)
        if p is None:
            # a Spark Python worker's first model imports the framework: with
            # the collector paused (ember._imports), and only for this load
            with collector_paused():
                p = _load(spec)
            _LOADS[source] = _LOADS.get(source, 0) + 1
            _CACHE[key] = p
        return p


_CHECKPOINTS: Dict[Tuple[str, int], str] = {}


def checkpoint_export(model_dir: str) -> Tuple[str, int]:
    """The latest TF1 checkpoint in ``model_dir`` (with its ``.meta`` graph) as a
    SavedModel (tag ``serve``, no signatures) in a local temporary directory,
    made once per process; returns (its path, the checkpoint's stamp).
    ``model_dir`` on HDFS: from the host's copy of that checkpoint.

    This is TensorFlowOnSpark's "checkpoint in ModelDir" style: the graph comes
    from the checkpoint's MetaGraph, so mappings name graph tensors.  A TF2
    object-based checkpoint holds no graph; export a SavedModel for those."""
    import tempfile

    tf = _import_tf()
    local, stamp = _model_files.checkpoint_dir(model_dir)
    ckpt = tf.train.latest_checkpoint(local)
    if not ckpt:
        raise _model_files.no_checkpoint(model_dir)
    meta = ckpt + ".meta"
    if not os.path.exists(meta):
        shown = ckpt if stamp is None else \
            hdfs.join(model_dir.rstrip("/"), os.path.relpath(ckpt, local))
        raise ModelInputError(f"checkpoint {shown} has no MetaGraph ({shown}.meta): only TF1 "
                              "checkpoints carry their graph; set ExportDir to a SavedModel")
    key = (ckpt, os.stat(meta).st_mtime_ns)
    with _CACHE_LOCK:
        out = _CHECKPOINTS.get(key)
        if out is None:
            out = os.path.join(tempfile.mkdtemp(prefix="ember-checkpoint-"), "saved_model")
            g = tf.Graph()
            with g.as_default():
                saver = tf.compat.v1.train.import_meta_graph(meta, clear_devices=True)
                with tf.compat.v1.Session(graph=g) as sess:
                    saver.restore(sess, ckpt)
                    builder = tf.compat.v1.saved_model.Builder(out)
                    builder.add_meta_graph_and_variables(sess, ["serve"])
                    builder.save()
            _CHECKPOINTS[key] = out
    return out, key[1] if stamp is None else stamp


# --------------------------------------------------------------------------- Arrow -> numpy

def arrow_type_rank(t: Any) -> Tuple[int, Any]:
    """(array nesting depth, element Arrow type) of a column type; ML vectors
    count as depth 1 of float64.  Raises ModelInputError for other types."""
    import pyarrow as pa

    depth = 0
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        depth += 1
        t = t.value_type
    if pa.types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} >= {"type", "values"}:
        return depth + 1, pa.float64()
    return depth, t


def _flatten_list(arr: Any, column: str, where: str) -> Tuple[Any, int]:
    """A list array of equal-length rows -> (flat values, row length); zero-copy."""
    n = len(arr)
    if n == 0:
        return arr.flatten(), 0
    offsets = np.asarray(arr.offsets)
    lengths = np.diff(offsets)
    width = int(lengths[0])
    if (lengths != width).any():
        bad = int(np.argmax(lengths != width))
        raise ModelInputError(f"column {column!r} has arrays of different lengths ({width} at "
                              f"row 0, {int(lengths[bad])} at row {bad} of {where})")
    return arr.flatten(), width


def column_to_numpy(arr: Any, column: str, info: TensorInfo, where: str,
                    tensor: Optional[Tuple[Any, Sequence[int]]] = None) -> np.ndarray:
    """Arrow column -> numpy array for the model input ``info`` (row axis first).

    Numbers, arrays of numbers (nested arrays too), dense ML vectors and
    tensor columns (``tensor``: their dtype and row shape, see ember.tensors);
    no Python object per value (the values buffer is viewed, then cast when the
    model wants another dtype).  Rows are reshaped to the model's row shape
    when only the flat length agrees (Spark arrays are flat)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if tensor is not None:
        from ember import tensors

        spec = (np.dtype(tensor[0]), tuple(tensor[1]))
        return fit_input(tensors.arrow_view(arr, spec, column, where), column, info, where)
    n = len(arr)
    if arr.null_count:
        raise ModelInputError(f"column {column!r} has a null in {where} (model input "
                              f"{info.key!r} needs a value in every row)")
    dims: List[int] = []
    t = arr.type
    while True:
        if pa.types.is_struct(t):  # pyspark.ml.linalg vector: (type, size, indices, values)
            kinds = np.asarray(arr.field("type").to_numpy(zero_copy_only=False))
            if (kinds != 1).any():
                raise ModelInputError(f"column {column!r} holds sparse vectors ({where}); "
                                      "model inputs need dense vectors (pyspark.ml.functions."
                                      "vector_to_array or a dense VectorAssembler output)")
            arr = arr.field("values")
            t = arr.type
            continue
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            if pa.types.is_fixed_size_list(t):
                width = t.list_size
                arr = arr.flatten()
            else:
                arr, width = _flatten_list(arr, column, where)
            dims.append(width)
            t = arr.type
            continue
        break
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise ModelInputError(f"column {column!r} has Arrow type {arr.type} in {where}; model "
                              f"input {info.key!r} needs numbers ({info.describe()})")
    flat = arr.to_numpy(zero_copy_only=False)
    return fit_input(flat.reshape((n, *dims)) if dims or flat.shape[0] != n else flat,
                     column, info, where)


def fit_input(x: np.ndarray, column: str, info: TensorInfo, where: str) -> np.ndarray:
    """Rows of ``column`` (row axis first) as model input ``info`` takes them:
    cast to its dtype, reshaped to its row shape when only the flat length
    agrees (Spark arrays are flat); raises when the rows do not fit."""
    n = x.shape[0]
    if x.dtype != info.dtype:
        x = x.astype(info.dtype)
    want = info.shape
    if want is not None and len(want) >= 1 and tuple(x.shape[1:]) != tuple(want[1:]):
        rest = want[1:]
        if all(d is not None for d in rest) and int(np.prod(rest, dtype=np.int64)) == \
                int(np.prod(x.shape[1:], dtype=np.int64)):
            x = x.reshape((n, *rest))
        elif not _shape_fits(x.shape[1:], rest):
            raise ModelInputError(f"column {column!r}: rows of shape {list(x.shape[1:])} in "
                                  f"{where}, but model input {info.key!r} takes "
                                  f"{info.describe()} (rows of {_row_shape(rest)})")
    return x


def _shape_fits(have: Sequence[int], want: Sequence[Any]) -> bool:
    return len(have) == len(want) and all(w is None or w == h for h, w in zip(have, want))


def _row_shape(dims: Sequence[Any]) -> str:
    return "scalars" if not dims else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def numpy_to_arrow(x: np.ndarray, info: TensorInfo, column: str) -> Any:
    """A model output (row axis first) -> an Arrow column: a number per row, or a
    flat list per row (rows of higher rank are flattened, row-major)."""
    import pyarrow as pa

    if x.ndim == 0:
        raise ModelInputError(f"model output {info.key!r} is a scalar, not one value per row")
    n = x.shape[0]
    if x.dtype.kind in "SUO":
        return pa.array(x.reshape(n, -1)[:, 0].tolist() if x.ndim > 1 else x.tolist(), pa.binary())
    if x.dtype == np.uint8:
        x = x.astype(np.int16)
    elif x.dtype == np.float16:
        x = x.astype(np.float32)
    elif x.dtype.kind == "u":
        x = x.astype(np.int64)
    if x.ndim == 1:
        return pa.array(x)
    width = int(np.prod(x.shape[1:], dtype=np.int64))
    values = pa.array(np.ascontiguousarray(x).reshape(-1))
    offsets = pa.array(np.arange(0, n * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, values)


def arrow_type(info: TensorInfo) -> Any:
    """The Arrow type of output ``info``'s column (see :func:`numpy_to_arrow`)."""
    import pyarrow as pa

    kind = info.dtype
    if kind.kind in "SUO":
        elem = pa.binary()
    elif kind == np.uint8:
        elem = pa.int16()
    elif kind.kind == "u":
        elem = pa.int64()
    elif kind == np.float16:
        elem = pa.float32()
    else:
        elem = pa.from_numpy_dtype(kind)
    if info.shape is None:
        raise ModelInputError(f"model output {info.key!r} has an unknown rank; its column "
                              "type cannot be derived")
    return elem if len(info.shape) <= 1 else pa.list_(elem)


def infer_partition(spec: Dict[str, Any], batches: Iterable[Any]) -> Iterator[Any]:
    """The ``mapInArrow`` function of EmberModel.transform: each Arrow batch in
    slices of ``spec['batch_size']`` rows through the cached model; yields the
    batch's columns (``spec['keep']``) plus the output columns."""
    import pyarrow as pa

    from ember._gpu import bind_task_gpus

    bind_task_gpus()  # the task's GPUs (spark.task.resource.gpu.amount), before the model loads
    p = predictor(spec)
    cols, out_cols, keep = spec["columns"], spec["output_columns"], spec["keep"]
    tensors = spec.get("tensors", {})
    step = max(1, int(spec["batch_size"]))
    schema = None
    for rb in batches:
        if rb.num_rows == 0:
            continue
        if schema is None:
            schema = pa.schema([rb.schema.field(c) for c in keep] +
                               [pa.field(c, arrow_type(info)) for c, info in zip(out_cols, p.outputs)])
        for off in range(0, rb.num_rows, step):
            part = rb.slice(off, step) if (off or rb.num_rows > step) else rb
            where = f"rows {off}..{off + part.num_rows - 1} of an Arrow batch"
            xs = [column_to_numpy(part.column(c), c, info, where, tensors.get(c))
                  for c, info in zip(cols, p.inputs)]
            arrays = [part.column(c) for c in keep]
            yield pa.RecordBatch.from_arrays(
                [a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, schema)] +
                outputs_to_arrow(p, p.run(xs), out_cols, part.num_rows), schema=schema)


def outputs_to_arrow(p: Any, ys: Sequence[np.ndarray], out_cols: Sequence[str],
                     rows: int) -> List[Any]:
    """The model's outputs for ``rows`` input rows as Arrow columns of their
    declared types (:func:`arrow_type`)."""
    arrays = []
    for y, info, c in zip(ys, p.outputs, out_cols):
        if y.ndim == 0 or y.shape[0] != rows:
            raise ModelInputError(f"model output {info.key!r} has shape {list(y.shape)} "
                                  f"for {rows} input rows")
        a, t = numpy_to_arrow(y, info, c), arrow_type(info)
        arrays.append(a if a.type == t else a.cast(t))
    return arrays


def infer_arrays(spec: Dict[str, Any], *columns: Any) -> Any:
    """The Arrow UDF of EmberModel.transform: input columns (pyarrow arrays of one
    Arrow batch) -> the output column, or a struct of the output columns."""
    import pyarrow as pa

    from ember._gpu import bind_task_gpus

    bind_task_gpus()  # the task's GPUs (spark.task.resource.gpu.amount), before the model loads
    p = predictor(spec)
    out_cols = spec["output_columns"]
    n = len(columns[0]) if columns else 0
    step = max(1, int(spec["batch_size"]))
    pieces: List[List[Any]] = [[] for _ in out_cols]
    for off in range(0, n, step):
        cols = [c.slice(off, step) if (off or n > step) else c for c in columns]
        rows = len(cols[0])
        where = f"rows {off}..{off + rows - 1} of an Arrow batch"
        xs = [column_to_numpy(a, c, info, where, spec.get("tensors", {}).get(c))
              for a, c, info in zip(cols, spec["columns"], p.inputs)]
        for i, a in enumerate(outputs_to_arrow(p, p.run(xs), out_cols, rows)):
            pieces[i].append(a)
    arrays = [pa.concat_arrays(x) if len(x) != 1 else x[0] for x in pieces]
    if not spec.get("struct"):
        return arrays[0]
    return pa.StructArray.from_arrays(arrays, names=out_cols)


def worker_loads(_: Any) -> Iterator[Any]:
    """mapInArrow helper for tests: (pid, the most times this Python worker
    loaded any one model)."""
    import pyarrow as pa

    for _b in _:
        pass
    yield pa.RecordBatch.from_pydict({"pid": pa.array([os.getpid()], pa.int64()),
                                      "loads": pa.array([max(_LOADS.values(), default=0)],
                                                         pa.int64())})
