"""TFRecord files of ``tf.train.Example``: Spark DataFrames in and out, and
batches for trainers.

The 5-line version::

    import ember.tfrecord as tfr
    tfr.save(df, "/data/train")                        # one part file per partition
    df2 = tfr.load(spark, "/data/train")               # schema inferred from a sample
    for batch in tfr.reader(files, 128, {"image": ("float32", 784), "label": "int64"},
                            shard=ctx):                # in main_fun(args, ctx)
        x, y = batch["image"], batch["label"]          # numpy arrays

Framing, CRC-32C checks, GZIP/ZLIB and Example decoding run in C (libember)
with the GIL released; batches arrive as numpy arrays over C buffers, with no
Python object per value.  Paths are local (or a shared mount such as NFS;
``file://`` prefixes are accepted) or HDFS URLs (``hdfs://nn:8020/data``,
``hdfs:///data``, ``webhdfs://nn:9870/data``), read and written by libember's
WebHDFS client (see :mod:`ember.hdfs`: no libhdfs, JVM or CLASSPATH; the
NameNode comes from ``$HADOOP_CONF_DIR``).
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import uuid
from typing import (Any, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import numpy as np

from ember import _ember
from ember import hdfs as _hdfs

EmberCorruptError = _ember.EmberCorruptError
EmberSchemaError = _ember.EmberSchemaError

BYTES, FLOAT, INT64 = _ember.EX_BYTES, _ember.EX_FLOAT, _ember.EX_INT64
_KIND_NAMES = {0: "no list", BYTES: "bytes_list", FLOAT: "float_list", INT64: "int64_list"}
_COMPRESSIONS = {None: 0, "": 0, "none": 0, "gzip": 1, "zlib": 2}
_EXT = {0: "", 1: ".gz", 2: ".zlib"}

#: A column of TFRecordWriter.write_examples: (name, kind, width, values,
#: value_offsets, row_offsets, present).
_ExampleColumn = Tuple[str, int, int, Any, Optional[np.ndarray], Optional[np.ndarray],
                       Optional[np.ndarray]]


class Ragged(NamedTuple):
    """A variable-length column: row ``i`` is ``values[row_splits[i]:row_splits[i+1]]``
    (the components of a ``tf.RaggedTensor``)."""

    values: np.ndarray
    row_splits: np.ndarray


# ---------------------------------------------------------------- files

def _local(path: str) -> str:
    if path.startswith("file://"):
        return path[len("file://"):]
    if "://" in path:
        raise ValueError(f"{path}: only local paths (file://) and HDFS URLs (hdfs://, "
                         "webhdfs://) are supported")
    return path


def _source(path: str) -> str:
    """What the C reader/writer opens: an HDFS URL as is, else a local path."""
    return path if _hdfs.is_hdfs(path) else _local(path)


def _is_data_name(name: str) -> bool:
    return not name.startswith(("_", "."))


def _list_hdfs(path: str) -> List[str]:
    try:
        st = _hdfs.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and st["type"] == "DIRECTORY":
        return [_hdfs.join(path, e["name"]) for e in _hdfs.list_status(path)
                if e["type"] == "FILE" and _is_data_name(e["name"])]
    if st is not None:
        return [path]
    found = _hdfs.glob(path)
    if not found:
        raise FileNotFoundError(f"no TFRecord files at {path}")
    return found


def list_files(path: Union[str, Sequence[str]]) -> List[str]:
    """The TFRecord files under ``path``: a file, a directory (its files not
    starting with ``_`` or ``.``, sorted), a glob, or a list of these."""
    if not isinstance(path, (str, os.PathLike)):
        return [f for p in path for f in list_files(p)]
    if _hdfs.is_hdfs(path):
        return _list_hdfs(path)
    p = _local(os.fspath(path))
    if os.path.isdir(p):
        return sorted(os.path.join(p, n) for n in os.listdir(p)
                      if not n.startswith(("_", ".")) and os.path.isfile(os.path.join(p, n)))
    if os.path.isfile(p):
        return [p]
    found = sorted(glob.glob(p))
    if not found:
        raise FileNotFoundError(f"no TFRecord files at {path}")
    return found


def detect_compression(path: str) -> int:
    """0 (none), 1 (GZIP) or 2 (ZLIB), from the file's first bytes: a valid
    TFRecord header means none; then the gzip magic, then a zlib header."""
    if _hdfs.is_hdfs(path):
        head = _ember.hdfs_read(path, 0, 12)
    else:
        with open(_local(path), "rb") as f:
            head = f.read(12)
    if len(head) == 12 and _ember.masked_crc32c(head[:8]) == int.from_bytes(head[8:], "little"):
        return 0
    if head[:2] == b"\x1f\x8b":
        return 1
    if len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        return 2
    return 0


def _compression(c: Union[str, int, None], path: str) -> int:
    if isinstance(c, int):
        return c
    if c == "auto":
        return detect_compression(path)
    try:
        return _COMPRESSIONS[c.lower() if isinstance(c, str) else c]
    except KeyError:
        raise ValueError(f"compression must be 'auto', None, 'gzip' or 'zlib', not {c!r}") from None


def open_reader(path: str, compression: Union[str, int, None] = "auto", check_crc: bool = True,
                skip_corrupt: bool = False) -> Any:
    """A C :class:`ember._ember.TFRecordReader` over ``path`` (iterate it for records)."""
    with _hdfs.errors():
        return _ember.TFRecordReader(_source(path), compression=_compression(compression, path),
                                     check_crc=check_crc, skip_corrupt=skip_corrupt)


def write(path: str, columns: Mapping[str, Any], compression: Optional[str] = None) -> int:
    """Writes numpy columns as a TFRecord file of Examples, one per row.

    ``columns`` maps feature names to arrays with the row axis first: floats
    become ``float_list`` (as float32), integers and bools ``int64_list``, and
    a sequence of ``bytes``/``str`` a one-value ``bytes_list``.  Returns the
    number of records.  An HDFS ``path`` is streamed to a temporary name
    beside it and renamed into place when complete."""
    cols: List[_ExampleColumn] = []
    n: Optional[int] = None
    for name, arr in columns.items():
        if isinstance(arr, np.ndarray) and arr.dtype.kind in "fiub":
            rows = arr.shape[0]
            width = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
            kind = FLOAT if arr.dtype.kind == "f" else INT64
            vals = np.ascontiguousarray(arr, np.float32 if kind == FLOAT else np.int64)
            cols.append((name, kind, width, vals, None, None, None))
        else:
            items = [v.encode() if isinstance(v, str) else bytes(v) for v in arr]
            rows = len(items)
            offs = np.zeros(rows + 1, np.uint64)
            np.cumsum([len(v) for v in items], out=offs[1:])
            cols.append((name, BYTES, 1, b"".join(items), offs, None, None))
        if n is not None and rows != n:
            raise ValueError(f"column {name!r} has {rows} rows, others {n}")
        n = rows
    if _hdfs.is_hdfs(path):
        head, name = path.rstrip("/").rsplit("/", 1)
        tmp = f"{head}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with _hdfs.errors():
                with _ember.TFRecordWriter(tmp, _compression(compression, path)) as w:
                    w.write_examples(cols, n or 0)
            _hdfs.rename(tmp, path, overwrite=True)
        except BaseException:
            try:
                _hdfs.delete(tmp)
            except Exception:  # the first error is the story
                pass
            raise
        return n or 0
    with _ember.TFRecordWriter(_local(path), _compression(compression, path)) as w:
        w.write_examples(cols, n or 0)
    return n or 0


# ---------------------------------------------------------------- trainer reader

_DTYPES = {"float32": FLOAT, "float64": FLOAT, "float16": FLOAT, "int64": INT64,
           "int32": INT64, "int16": INT64, "int8": INT64, "uint8": INT64, "bool": INT64,
           "bytes": BYTES, "str": BYTES, "string": BYTES}


class _Col(NamedTuple):
    name: str
    kind: int
    dtype: str          # numpy dtype name, "bytes" or "str"
    shape: Optional[Tuple[int, ...]]  # per row; None = variable length

    @property
    def width(self) -> int:
        return 0 if self.shape is None else int(np.prod(self.shape, dtype=np.int64))


def _parse_col(name: str, spec: Any) -> _Col:
    shape: Optional[Tuple[int, ...]] = ()
    if isinstance(spec, tuple):
        spec, shape = spec
        if isinstance(shape, int):
            shape = (shape,)
        elif shape is not None:
            shape = tuple(int(d) for d in shape)
    if spec in (bytes, str):
        dt = spec.__name__
    else:
        dt = spec if isinstance(spec, str) and spec in ("bytes", "str", "string") else np.dtype(spec).name
    if dt == "string":
        dt = "str"
    if dt not in _DTYPES:
        raise ValueError(f"column {name!r}: unsupported dtype {spec!r}")
    if shape is not None and any(d <= 0 for d in shape):
        raise ValueError(f"column {name!r}: shape dimensions must be positive, not {shape}")
    return _Col(name, _DTYPES[dt], dt, shape)


def _infer_cols(names: Sequence[str], files: Sequence[str], compression: Any) -> List[_Col]:
    for f in files:
        with open_reader(f, compression) as r:
            rec = r.next()
        if rec is None:
            continue
        feats = _ember.example_parse(rec)
        out = []
        for n in names:
            if n not in feats:
                raise EmberSchemaError(f"{f}: record 0 has no feature {n!r}; pass its spec")
            kind, vals = feats[n]
            count = len(vals) if kind == BYTES else len(vals) // (4 if kind == FLOAT else 8)
            dt = {BYTES: "bytes", FLOAT: "float32", INT64: "int64"}.get(kind)
            if dt is None:
                raise EmberSchemaError(f"{f}: record 0: feature {n!r} has no list; pass its spec")
            out.append(_Col(n, kind, dt, () if count == 1 else (count,)))
        return out
    raise ValueError("cannot infer column types: the files hold no records")


def _shard(shard: Any) -> Tuple[int, int]:
    if shard is None:
        return 0, 1
    if hasattr(shard, "worker_num") and hasattr(shard, "num_workers"):
        return int(shard.worker_num), int(shard.num_workers)
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} not in 0..{count - 1}")
    return int(index), int(count)


def _column_array(col: _Col, parts: Tuple[Any, Any, Any, Any], n: int) -> Any:
    values, voff, roff, _present = parts
    arr: np.ndarray
    if col.kind == BYTES:
        data = memoryview(values).cast("B")
        offs = np.asarray(voff)
        vals = np.empty(len(offs) - 1, dtype=object)
        conv = (lambda b: str(b, "utf-8")) if col.dtype == "str" else bytes
        for i in range(len(vals)):  # one object per value: bytes have no numpy form
            vals[i] = conv(data[offs[i]:offs[i + 1]])
        arr = vals
    else:
        arr = np.asarray(values)
        if arr.dtype.name != col.dtype:
            arr = arr.astype(col.dtype)
    if col.shape is None:
        return Ragged(arr, np.asarray(roff).astype(np.int64))
    return arr.reshape((n,) + col.shape)


def reader(paths: Union[str, Sequence[str]], batch_size: int,
           columns: Union[Mapping[str, Any], Sequence[str]], *, shard: Any = None,
           num_epochs: int = 1, shuffle_files: bool = False, shuffle_buffer: int = 0,
           seed: int = 0, drop_remainder: bool = False,
           compression: Union[str, int, None] = "auto",
           check_crc: bool = True, skip_corrupt: bool = False) -> Iterator[Dict[str, Any]]:
    """Yields batches of decoded Examples as ``{name: numpy array}``.

    :param paths: TFRecord files, directories or globs (see :func:`list_files`).
    :param batch_size: rows per batch; the last one may be smaller unless
        ``drop_remainder``.
    :param columns: ``{name: spec}`` with spec a dtype (``"float32"``, ``"int64"``,
        ``"bytes"``, ``"str"``: one value per record, arrays of shape
        ``(batch,)``), ``(dtype, shape)`` for a fixed number of values per record
        (shape ``(batch, *shape)``), or ``(dtype, None)`` for variable length
        (a :class:`Ragged`).  A list of names infers specs from the first record.
    :param shard: ``(index, count)`` or the node ``ctx``: this worker reads
        files ``index::count``, or, with fewer files than workers, records
        ``index::count`` of every file.
    :param num_epochs: passes over the data (``None``: forever).
    :param shuffle_files: each pass reads the files in a new order (seeded).
    :param shuffle_buffer: records are shuffled within windows of this many
        (rounded up to whole batches; 0: in file order): each window is read,
        then handed out in a seeded random order, each batch gathered (in C)
        into fresh arrays the reader never writes again; the window's memory
        is reused for the next.  Unlike
        ``tf.data``'s sliding shuffle buffer this needs no thread and no
        per-record step, so a training loop can read on its own thread.
    :param skip_corrupt: skip and count corrupt records instead of raising
        :class:`EmberCorruptError`.

    A record that does not match the specs raises :class:`EmberSchemaError`
    naming the file, record and feature.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, not {batch_size}")
    if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer must be an int >= 0 (records), not {shuffle_buffer!r}")
    files = list_files(paths)
    index, count = _shard(shard)
    if isinstance(columns, Mapping):
        cols = [_parse_col(k, v) for k, v in columns.items()]
    else:
        cols = _infer_cols(list(columns), files, compression)
    if len(files) >= count:
        mine, every, phase = files[index::count], 1, 0
    else:
        mine, every, phase = files, count, index
    specs = [(c.name, c.kind, c.width, 0) for c in cols]
    decoder = _ember.ExampleDecoder(specs)
    window = -(-shuffle_buffer // batch_size) * batch_size if shuffle_buffer else batch_size
    rng = np.random.default_rng(seed) if shuffle_buffer else None

    def batches(last: bool) -> Iterator[Dict[str, Any]]:
        if rng is None:
            yield _columns(cols, decoder.take())
            return
        # each batch is gathered (in C) from the window the decoder holds,
        # which is then cleared: its memory serves every window, where taking
        # it would fault in a fresh 31 MB per 10,000 Fashion-MNIST records
        # (3.5 us a record, twice the decoding)
        order = rng.permutation(decoder.rows)
        try:
            for lo in range(0, len(order), batch_size):
                rows = order[lo:lo + batch_size]
                if len(rows) < batch_size and last and drop_remainder:
                    return
                yield _columns(cols, decoder.gather(rows))
        finally:
            decoder.clear()

    epoch = 0
    while num_epochs is None or epoch < num_epochs:
        order = list(mine)
        if shuffle_files:
            random.Random(seed + epoch).shuffle(order)
        for f in order:
            with open_reader(f, compression, check_crc, skip_corrupt) as r:
                while True:
                    got = r.read_examples(decoder, window - decoder.rows, every, phase)
                    if decoder.rows == window:
                        yield from batches(False)
                    elif got == 0:
                        break
        epoch += 1
    if decoder.rows and (not drop_remainder or decoder.rows >= batch_size):
        yield from batches(True)


def _columns(cols: List[_Col], taken: Tuple[int, List[Any]]) -> Dict[str, Any]:
    """``{name: array}`` from what ``ExampleDecoder.take`` or ``gather`` returned."""
    n, parts = taken
    return {c.name: _column_array(c, p, n) for c, p in zip(cols, parts)}


def dataset(paths: Union[str, Sequence[str]], batch_size: int,
            columns: Union[Mapping[str, Any], Sequence[str]], **kwargs: Any) -> Any:
    """The :func:`reader` as a ``tf.data.Dataset`` of ``{name: tensor}`` batches
    (variable-length columns become ``tf.RaggedTensor``; ``bytes`` ``tf.string``).
    Takes the same arguments as :func:`reader`."""
    import tensorflow as tf

    files = list_files(paths)
    if isinstance(columns, Mapping):
        cols = [_parse_col(k, v) for k, v in columns.items()]
    else:
        cols = _infer_cols(list(columns), files, kwargs.get("compression", "auto"))
    spec_map = {c.name: ((c.dtype, c.shape) if c.shape != () else c.dtype) for c in cols}
    sig = {}
    for c in cols:
        dt = tf.string if c.kind == BYTES else tf.as_dtype(c.dtype)
        if c.shape is None:
            sig[c.name] = tf.RaggedTensorSpec((None, None), dt, 1, tf.int64)
        else:
            sig[c.name] = tf.TensorSpec((None,) + c.shape, dt)

    def gen() -> Iterator[Dict[str, Any]]:
        for b in reader(files, batch_size, spec_map, **kwargs):
            yield {k: (tf.RaggedTensor.from_row_splits(v.values, v.row_splits)
                       if isinstance(v, Ragged) else v) for k, v in b.items()}

    return tf.data.Dataset.from_generator(gen, output_signature=sig)


# ---------------------------------------------------------------- schema

def _spark_types() -> Any:
    from pyspark.sql import types as T
    return T


def _field_plan(field: Any) -> Tuple[str, int, bool]:
    """(name, kind, is_list) for a Spark field, or TypeError."""
    T = _spark_types()
    t, is_list = field.dataType, False
    if isinstance(t, T.ArrayType):
        t, is_list = t.elementType, True
    if isinstance(t, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)):
        return field.name, INT64, is_list
    if isinstance(t, (T.FloatType, T.DoubleType)):
        return field.name, FLOAT, is_list
    if isinstance(t, (T.StringType, T.BinaryType)):
        return field.name, BYTES, is_list
    raise TypeError(f"field {field.name!r}: {field.dataType.simpleString()} has no "
                    "tf.train.Example form (use numbers, strings, binary or arrays of them)")


def infer_schema(path: Union[str, Sequence[str]], sample: int = 100,
                 compression: Union[str, int, None] = "auto") -> Any:
    """A Spark ``StructType`` for the Examples in ``path``, from its first
    ``sample`` records: int64 -> long, float -> float, bytes -> string (binary
    when a value is not UTF-8); an array type when a record has other than one
    value; every field nullable; fields sorted by name (as TFoS's dfutil)."""
    T = _spark_types()
    seen: Dict[str, Dict[str, Any]] = {}
    n = 0
    for f in list_files(path):
        with open_reader(f, compression) as r:
            for rec in r:
                for name, (kind, vals) in _ember.example_parse(rec).items():
                    s = seen.setdefault(name, {"kinds": {}, "multi": False, "utf8": True})
                    count = (len(vals) if kind in (BYTES, 0)
                             else len(vals) // (4 if kind == FLOAT else 8))
                    if kind:
                        s["kinds"].setdefault(kind, f"{f} record {r.stats['records'] - 1}")
                    s["multi"] |= count != 1
                    if kind == BYTES and s["utf8"]:
                        try:
                            for v in vals:
                                v.decode("utf-8")
                        except UnicodeDecodeError:
                            s["utf8"] = False
                n += 1
                if n >= sample:
                    break
        if n >= sample:
            break
    fields = []
    for name in sorted(seen):
        s = seen[name]
        if len(s["kinds"]) > 1:
            where = ", ".join(f"{_KIND_NAMES[k]} in {w}" for k, w in s["kinds"].items())
            raise EmberSchemaError(f"feature {name!r} has conflicting kinds: {where}")
        kind = next(iter(s["kinds"]), BYTES)
        base = {INT64: T.LongType(), FLOAT: T.FloatType(),
                BYTES: T.StringType() if s["utf8"] else T.BinaryType()}[kind]
        fields.append(T.StructField(name, T.ArrayType(base, True) if s["multi"] else base, True))
    return T.StructType(fields)


# ---------------------------------------------------------------- Spark save

def _arrow_columns(batch: Any, plan: Sequence[Tuple[str, int, bool]]
                   ) -> List[_ExampleColumn]:
    """Arrow record batch -> write_examples columns, without per-value objects."""
    import pyarrow as pa

    out: List[_ExampleColumn] = []
    for name, kind, is_list in plan:
        arr = batch.column(batch.schema.get_field_index(name))
        present = None
        if arr.null_count:
            present = np.asarray(arr.is_valid(), dtype=np.uint8)
        if is_list:
            roff = np.asarray(arr.offsets).astype(np.uint64)
            child = arr.values
            if child.null_count:
                raise ValueError(f"field {name!r}: arrays with null elements cannot be written "
                                 "as tf.train.Example lists")
        else:
            roff, child = None, arr
        if kind == BYTES:
            bufs = child.buffers()
            odt = np.int64 if pa.types.is_large_binary(child.type) or \
                pa.types.is_large_string(child.type) else np.int32
            voff = np.frombuffer(bufs[1], odt)[child.offset:child.offset + len(child) + 1] \
                .astype(np.uint64) if bufs[1] is not None else np.zeros(1, np.uint64)
            data = bufs[2]
            vals: Any = data if data is not None else b""
            nvalues = len(child)
        else:
            dt = np.float32 if kind == FLOAT else np.int64
            if child.null_count:
                child = child.fill_null(False if pa.types.is_boolean(child.type) else 0)
            vals = np.asarray(child.to_numpy(zero_copy_only=False), dtype=dt)
            voff, nvalues = None, len(child)
        if not is_list:
            out.append((name, kind, 1, vals, voff, None, present))
        else:
            if kind != BYTES and len(vals) != nvalues:
                raise ValueError(f"field {name!r}: inconsistent array lengths")
            out.append((name, kind, 0, vals, voff, roff, present))
    return out


def save(df: Any, path: str, *, compression: Optional[str] = None, mode: str = "error",
         level: int = -1) -> int:
    """Writes ``df`` as TFRecord files of ``tf.train.Example``, one part file per
    partition (``part-00000.tfrecord``, ``.gz`` when GZIP), and ``_SUCCESS``.

    Numbers become int64/float lists of one value, strings and binary a
    ``bytes_list``, arrays lists; nulls leave the feature out of the record.
    Each task writes ``_temporary/`` then renames its file into place, so a
    failed or retried task never leaves a partial part file visible.  An
    ``hdfs://`` path is written the same way over WebHDFS (streamed by the C
    writer, then an atomic RENAME); executors without ``HADOOP_CONF_DIR``
    use the driver's when that directory exists on their host.

    :param mode: ``"error"`` (the path must not exist or be empty) or
        ``"overwrite"``.
    :returns: the number of records written.
    """
    from pyspark import TaskContext

    if _hdfs.is_hdfs(path):
        return _save_hdfs(df, path, compression, mode, level)
    root = os.path.abspath(_local(path))
    comp = _compression(compression, root)
    plan = [_field_plan(f) for f in df.schema.fields]
    if os.path.exists(root) and os.listdir(root):
        if mode == "overwrite":
            shutil.rmtree(root)
        elif mode == "error":
            raise FileExistsError(f"{path} exists and is not empty (use mode='overwrite')")
        else:
            raise ValueError(f"mode must be 'error' or 'overwrite', not {mode!r}")
    tmpdir = os.path.join(root, "_temporary")
    os.makedirs(tmpdir, exist_ok=True)
    ext = _EXT[comp]

    def write_part(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        pid = ctx.partitionId()
        tmp = os.path.join(tmpdir, f"part-{pid:05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex}")
        try:
            w = _ember.TFRecordWriter(tmp, comp, level)
            for b in batches:
                if b.num_rows:
                    w.write_examples(_arrow_columns(b, plan), b.num_rows)
            w.close()
            os.replace(tmp, os.path.join(root, f"part-{pid:05d}.tfrecord{ext}"))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        yield pa.RecordBatch.from_arrays([pa.array([pid], pa.int32()),
                                          pa.array([w.records], pa.int64())],
                                         names=["partition", "records"])

    rows = df.mapInArrow(write_part, "partition int, records long").collect()
    shutil.rmtree(tmpdir, ignore_errors=True)
    open(os.path.join(root, "_SUCCESS"), "w").close()
    return sum(r.records for r in rows)


def _save_hdfs(df: Any, path: str, compression: Optional[str], mode: str, level: int) -> int:
    """save() to an HDFS URL: part files streamed to ``_temporary/`` by the C
    WebHDFS writer, each renamed into place (atomic) when complete."""
    from pyspark import TaskContext

    if mode not in ("error", "overwrite"):
        raise ValueError(f"mode must be 'error' or 'overwrite', not {mode!r}")
    root = path.rstrip("/")
    comp = _compression(compression, root)
    plan = [_field_plan(f) for f in df.schema.fields]
    if _hdfs.exists(root) and (not _hdfs.isdir(root) or _hdfs.listdir(root)):
        if mode == "error":
            raise FileExistsError(f"{path} exists and is not empty (use mode='overwrite')")
        _hdfs.delete(root, recursive=True)
    tmpdir = root + "/_temporary"
    _hdfs.makedirs(tmpdir)
    ext = _EXT[comp]
    conf_dir = os.environ.get("HADOOP_CONF_DIR")

    def write_part(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        _hdfs.ensure_conf_dir(conf_dir)
        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        pid = ctx.partitionId()
        tmp = f"{tmpdir}/part-{pid:05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex}"
        try:
            with _hdfs.errors():
                w = _ember.TFRecordWriter(tmp, comp, level)
                for b in batches:
                    if b.num_rows:
                        w.write_examples(_arrow_columns(b, plan), b.num_rows)
                w.close()
            # replaces a file an earlier attempt of this task renamed (same rows)
            _hdfs.rename(tmp, f"{root}/part-{pid:05d}.tfrecord{ext}", overwrite=True)
        except BaseException:
            try:
                _hdfs.delete(tmp)
            except Exception:
                pass
            raise
        yield pa.RecordBatch.from_arrays([pa.array([pid], pa.int32()),
                                          pa.array([w.records], pa.int64())],
                                         names=["partition", "records"])

    rows = df.mapInArrow(write_part, "partition int, records long").collect()
    _hdfs.delete(tmpdir, recursive=True)
    _hdfs.write_bytes(root + "/_SUCCESS", b"")
    return sum(r.records for r in rows)


# ---------------------------------------------------------------- Spark load

def _violation(where: str, name: str, what: str) -> EmberSchemaError:
    return EmberSchemaError(f"{where}: field {name!r}: {what}")


def _arrow_field(field: Any, afield: Any, kind: int, is_list: bool, parts: Tuple, n: int,
                 where: Any) -> Any:
    """Decoder output for one field -> an Arrow array of type ``afield.type``
    (the Spark field's Arrow form), checking the schema on the way
    (``where(row)`` names a record for messages)."""
    import pyarrow as pa

    values, voff, roff, present = parts
    present = np.asarray(present).astype(bool)
    rs = np.asarray(roff).astype(np.int64)
    counts = np.diff(rs)
    if not field.nullable and not present.all():
        i = int(np.argmin(present))
        raise _violation(where(i), field.name, "missing, but the schema says not nullable")
    target = afield.type.value_type if is_list else afield.type
    tname = (field.dataType.elementType if is_list else field.dataType).simpleString()
    if kind == BYTES:
        offs = np.asarray(voff)
        if offs[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"field {field.name!r}: over 2 GiB of bytes in one batch")
        base = pa.string() if pa.types.is_string(target) or pa.types.is_large_string(target) \
            else pa.binary()
    vals = None if kind == BYTES else np.asarray(values)
    if kind == INT64 and pa.types.is_integer(target) and target.bit_width < 64:
        assert vals is not None  # not BYTES
        info = np.iinfo(target.to_pandas_dtype())
        out = (vals < info.min) | (vals > info.max)
        if out.any():
            i = int(np.searchsorted(rs, int(np.argmax(out)), side="right") - 1)
            raise _violation(where(i), field.name, f"value out of range for {tname}")
    if not is_list:
        bad = present & (counts > 1)
        if bad.any():
            i = int(np.argmax(bad))
            raise _violation(where(i), field.name,
                             f"{int(counts[i])} values for the scalar type {tname} "
                             "(declare an array type to keep them)")
        valid = present & (counts == 1)
        if not field.nullable and not valid.all():
            i = int(np.argmin(valid))
            raise _violation(where(i), field.name, "empty, but the schema says not nullable")
        mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
        if kind == BYTES:
            row_offs = np.asarray(offs[rs], dtype=np.int32)
            arr = pa.Array.from_buffers(base, n, [mask, pa.py_buffer(row_offs),
                                                  pa.py_buffer(values)])
        else:
            assert vals is not None  # not BYTES
            dense = np.zeros(n, vals.dtype)
            dense[valid] = vals[rs[:-1][valid]]
            arr = pa.array(dense, mask=~valid)
    else:
        if kind == BYTES:
            child = pa.Array.from_buffers(base, len(offs) - 1,
                                          [None, pa.py_buffer(offs.astype(np.int32)),
                                           pa.py_buffer(values)])
        else:
            child = pa.array(vals)
        child = child.cast(target)
        arr = pa.ListArray.from_arrays(pa.array(rs.astype(np.int32)), child, type=afield.type,
                                       mask=None if present.all() else pa.array(~present))
    if kind == BYTES and pa.types.is_string(base):
        try:
            (arr.values if is_list else arr).validate(full=True)
        except pa.ArrowInvalid:
            for i in range(n):  # find the record, for the message
                try:
                    arr.slice(i, 1).validate(full=True)
                except pa.ArrowInvalid:
                    raise _violation(where(i), field.name,
                                     "bytes that are not UTF-8 for a string field") from None
            raise
    return arr if arr.type == afield.type else arr.cast(afield.type)


def load(spark: Any, path: Union[str, Sequence[str]], schema: Any = None, *,
         compression: Union[str, int, None] = "auto", sample: int = 100,
         skip_corrupt: bool = False, batch_size: int = 4096) -> Any:
    """Reads TFRecord files of ``tf.train.Example`` into a DataFrame, one
    partition per file.

    :param schema: a ``StructType`` (or DDL string) to enforce; None infers one
        with :func:`infer_schema` from the first ``sample`` records.  A feature
        missing from a record gives null; a record that violates the schema
        (wrong kind, several values for a scalar, null in a non-nullable
        field, non-UTF-8 for a string) raises naming the file, record and field.
    :param skip_corrupt: skip and count corrupt records instead of failing.
    """
    files = list_files(path)
    if schema is None:
        schema = infer_schema(files, sample, compression)
    elif isinstance(schema, str):
        from pyspark.sql.types import _parse_datatype_string
        schema = _parse_datatype_string(schema)
    plan = [_field_plan(f) for f in schema.fields]
    specs = [(name, kind, 0, _ember.EX_OPTIONAL) for name, kind, _ in plan]
    conf_dir = os.environ.get("HADOOP_CONF_DIR")

    def read_part(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        _hdfs.ensure_conf_dir(conf_dir)
        aschema = _arrow_schema(schema)
        for b in batches:
            for idx in b.column(0).to_pylist():
                f = files[idx]
                decoder = _ember.ExampleDecoder(specs)
                first = 0
                with open_reader(f, compression, True, skip_corrupt) as r:
                    while r.read_examples(decoder, batch_size):
                        n, parts = decoder.take()
                        where = lambda i, base=first: f"{f}: record {base + i}"  # noqa: E731
                        arrays = [_arrow_field(fld, af, kind, is_list, p, n, where)
                                  for fld, af, (_, kind, is_list), p
                                  in zip(schema.fields, aschema, plan, parts)]
                        yield pa.RecordBatch.from_arrays(arrays, schema=aschema)
                        first += n

    ids = spark.range(0, len(files), 1, numPartitions=max(1, len(files)))
    return ids.mapInArrow(read_part, schema)


def _arrow_schema(schema: Any) -> Any:
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(schema)


# ---------------------------------------------------------------- inspect

def inspect(path: str, records: int = 3, compression: Union[str, int, None] = "auto",
            skip_corrupt: bool = False) -> Dict[str, Any]:
    """Scans one TFRecord file: ``{"path", "compression", "records",
    "data_bytes", "features": {name: {"kind", "min", "max", "present"}},
    "first": [decoded records], "skipped", "error"}``; ``error`` is the
    message of a corrupt or truncated record (naming its byte offset), or None."""
    with _hdfs.errors():
        comp = _compression(compression, path)
    out: Dict[str, Any] = {"path": path, "compression": ["none", "gzip", "zlib"][comp],
                           "features": {}, "first": [], "error": None}
    feats: Dict[str, Dict[str, Any]] = out["features"]
    with _hdfs.errors():
        r = _ember.TFRecordReader(_source(path), compression=comp, skip_corrupt=skip_corrupt)
    with r:
        try:
            for rec in r:
                try:
                    parsed = _ember.example_parse(rec)
                except EmberCorruptError as e:
                    i = r.stats["records"] - 1
                    raise EmberCorruptError(f"{path}: record {i} (byte offset "
                                            f"{r.stats['last_offset']}): {e}") from None
                decoded = {}
                for name, (kind, vals) in parsed.items():
                    if kind == FLOAT:
                        v: Any = np.frombuffer(vals, "<f4").tolist()
                    elif kind == INT64:
                        v = np.frombuffer(vals, "<i8").tolist()
                    else:
                        v = list(vals)
                    s = feats.setdefault(name, {"kind": _KIND_NAMES[kind], "min": len(v),
                                                "max": len(v), "present": 0})
                    if s["kind"] != _KIND_NAMES[kind]:
                        s["kind"] = "mixed"
                    s["min"], s["max"] = min(s["min"], len(v)), max(s["max"], len(v))
                    s["present"] += 1
                    decoded[name] = v
                if len(out["first"]) < records:
                    out["first"].append(decoded)
        except EmberCorruptError as e:
            out["error"] = str(e)
        st = r.stats
    out.update(records=st["records"], data_bytes=st["data_bytes"], skipped=st["skipped"],
               skipped_bytes=st["skipped_bytes"])
    return out
