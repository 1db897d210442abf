"""Tensor columns: fixed-shape numeric arrays packed as one binary value per row.

Spark holds an ``array<float>`` row as an array object of elements, and its
Arrow export (the path of every Python consumer of a DataFrame: ``mapInArrow``,
pandas UDFs, Ember's feed) writes those elements one at a time in the JVM.  A
tensor column holds the same values as one little-endian byte string per row
(``BinaryType``) that Spark caches, scans and exports as a single copy; the
field's metadata records the dtype and shape.  Ember's feed hands such a
column to the trainer as the same ``(rows, *shape)`` numpy array an array
column gives, a view of the Arrow buffer (no copy, no per-value work).

    df = ember.tensors.pack(df, {"image": (28, 28)}).cache()
    cluster.train(df)      # batch.column("image"): float32, shape (n, 28, 28)
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from ember.errors import EmberFeedError

#: StructField metadata key of a tensor column: {"dtype": "<f4", "shape": [28, 28]}.
METADATA_KEY = "ember_tensor"

#: Spark element type name -> the numpy dtype a packed value holds.
_ELEMENT_DTYPES = {"float": "<f4", "double": "<f8", "integer": "<i4", "long": "<i8"}

# Arrow's binary offsets are int32: pack at most this many bytes per output batch.
_MAX_BATCH_BYTES = 1 << 30

TensorSpec = Tuple[np.dtype, Tuple[int, ...]]


def field_spec(field: Any) -> Optional[TensorSpec]:
    """(dtype, row shape) of a Spark StructField that is a tensor column, else None."""
    meta = (field.metadata or {}).get(METADATA_KEY)
    if meta is None or field.dataType.typeName() != "binary":
        return None
    return np.dtype(meta["dtype"]), tuple(int(d) for d in meta["shape"])


def tensor_specs(schema: Any) -> Dict[str, TensorSpec]:
    """{column: (dtype, row shape)} of the tensor columns of a Spark schema."""
    specs = {}
    for field in schema.fields:
        spec = field_spec(field)
        if spec is not None:
            specs[field.name] = spec
    return specs


def pack(df: Any, shapes: Mapping[str, Sequence[int]]) -> Any:
    """``df`` with each named ``array<float|double|int|bigint>`` column packed
    as a tensor column of the given row shape.  Other columns pass unchanged.

    Lazy, like any transformation; a row whose array is null, holds a null or
    has the wrong number of values fails the job with an
    :class:`ember.errors.EmberFeedError` naming the partition, the column, the
    row (counted from the partition's start) and the null's element.
    """
    from pyspark.sql.types import ArrayType, BinaryType, StructField, StructType

    fields, specs = [], {}
    for field in df.schema.fields:
        if field.name not in shapes:
            fields.append(field)
            continue
        t = field.dataType
        if not isinstance(t, ArrayType) or t.elementType.typeName() not in _ELEMENT_DTYPES:
            raise TypeError(f"ember.tensors.pack: column {field.name!r} is {t.simpleString()}; "
                            "expected array<float|double|int|bigint>")
        shape = tuple(int(d) for d in shapes[field.name])
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"ember.tensors.pack: column {field.name!r}: shape {shape} must "
                             "have at least one dimension, all positive")
        dtype = _ELEMENT_DTYPES[t.elementType.typeName()]
        specs[field.name] = (dtype, shape)
        fields.append(StructField(field.name, BinaryType(), False))
    missing = sorted(set(shapes) - set(specs))
    if missing:
        raise ValueError(f"ember.tensors.pack: no column {missing[0]!r} in {df.columns}")
    if not specs:
        return df
    return declare(df.mapInArrow(_packer(specs), StructType(fields)), specs)


def declare(df: Any, specs: Mapping[str, Tuple[Any, Sequence[int]]]) -> Any:
    """``df`` with each named binary column marked as a tensor column of
    ``(dtype, row shape)``: what :func:`pack` does once it has packed them,
    for a column a ``mapInArrow`` function made with :func:`to_arrow`::

        def decode(batches):
            for rb in batches:
                images = my_decoder(rb.column("jpeg"))   # (n, 224, 224, 3) uint8
                yield pa.RecordBatch.from_arrays([ember.tensors.to_arrow(images)], ["image"])

        df = ember.tensors.declare(files.mapInArrow(decode, "image binary"),
                                   {"image": (np.uint8, (224, 224, 3))})
    """
    names = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    for name, (dtype, shape) in specs.items():
        if names.get(name) != "binary":
            raise TypeError(f"ember.tensors.declare: column {name!r} is "
                            f"{names.get(name, 'missing')}; a tensor column is binary")
        dt = np.dtype(dtype).newbyteorder("<")
        if dt.kind not in "iuf":
            raise TypeError(f"ember.tensors.declare: column {name!r}: dtype {dt} is not numeric")
        df = df.withMetadata(name, {METADATA_KEY: {  # what tensor_specs() and the feed read
            "dtype": dt.str, "shape": [int(d) for d in shape]}})
    return df


def to_arrow(values: np.ndarray) -> Any:
    """The rows of ``values`` (``(n, *shape)``, numeric) as the Arrow values
    of a tensor column: ``n`` byte strings, each one row little-endian (a
    copy only where ``values`` is not contiguous little-endian).  Mark the
    column with :func:`declare`."""
    import pyarrow as pa

    values = np.asarray(values)
    if values.ndim < 2 or values.dtype.kind not in "iuf":
        raise TypeError(f"ember.tensors.to_arrow: expected a numeric array of rows (n, *shape), "
                        f"got {values.dtype} {values.shape}")
    flat = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    n, row = flat.shape[0], int(np.prod(flat.shape[1:])) * flat.itemsize
    if n * row >= 1 << 31:  # Arrow's binary offsets are int32
        raise ValueError(f"ember.tensors.to_arrow: {n} rows of {row} bytes pass Arrow's 2 GiB "
                         "per binary array; yield them in smaller batches")
    offsets = np.arange(n + 1, dtype=np.int64) * row
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                  pa.py_buffer(flat.reshape(-1))])


def _packer(specs: Dict[str, Tuple[str, Tuple[int, ...]]]) -> Any:
    def pack_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        partition = ctx.partitionId()
        row = 0
        widest = max(int(np.prod(s)) * np.dtype(d).itemsize for d, s in specs.values())
        step = max(1, _MAX_BATCH_BYTES // widest)
        for rb in batches:
            for off in range(0, rb.num_rows, step):
                part = rb.slice(off, step)
                cols = []
                for name in part.schema.names:
                    col = part.column(name)
                    if name in specs:
                        col = _pack_column(col, name, *specs[name],
                                           where=f"ember.tensors.pack: partition {partition}",
                                           first=row)
                    cols.append(col)
                yield pa.RecordBatch.from_arrays(cols, names=part.schema.names)
                row += part.num_rows
    return pack_batches


def _pack_column(col: Any, name: str, dtype: str, shape: Tuple[int, ...], where: str,
                 first: int = 0) -> Any:
    """One packed column; rows are named ``first`` + their index in ``col``."""
    width = int(np.prod(shape))
    n = len(col)
    if col.null_count:
        raise EmberFeedError(f"{where}: column {name!r} has a null array at row "
                             f"{first + col.is_null().to_pylist().index(True)}")
    lengths = np.diff(col.offsets.to_numpy())
    bad = np.flatnonzero(lengths != width)
    if bad.size:
        raise EmberFeedError(f"{where}: column {name!r} row {first + int(bad[0])} has "
                             f"{int(lengths[bad[0]])} values; its tensor shape {shape} needs "
                             f"{width}")
    values = col.flatten()
    if values.null_count:  # every row holds width values (checked above)
        at = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise EmberFeedError(f"{where}: column {name!r} row {first + at // width}, element "
                             f"{at % width} is null; a tensor holds none")
    flat = values.to_numpy(zero_copy_only=False).astype(np.dtype(dtype), copy=False)
    return to_arrow(flat.reshape((n,) + shape))


def view(values: Any, offsets: np.ndarray, n: int, spec: TensorSpec, field: str,
         where: str, first: int = 0) -> np.ndarray:
    """The ``(n, *shape)`` array of a tensor column's packed values (a view).

    ``values`` holds rows ``offsets[0]..offsets[n]``; raises
    :class:`ember.errors.EmberFeedError` naming the field and row (``first``:
    the index of the first row in its partition) when a value is not exactly
    one tensor long."""
    dtype, shape = spec
    row_bytes = int(np.prod(shape)) * dtype.itemsize
    lengths = np.diff(offsets)
    bad = np.flatnonzero(lengths != row_bytes)
    if bad.size:
        raise EmberFeedError(f"{where}: tensor column {field!r} row {first + int(bad[0])} "
                             f"has {int(lengths[bad[0]])} bytes; {dtype.name}{list(shape)} is "
                             f"{row_bytes}")
    return np.frombuffer(values, dtype=dtype, count=n * row_bytes // dtype.itemsize
                         ).reshape((n,) + shape)


def arrow_view(col: Any, spec: TensorSpec, field: str, where: str,
               first: int = 0) -> np.ndarray:
    """The ``(n, *shape)`` array of a tensor column's Arrow binary array (a view)."""
    from ember._columns import arrow_binary

    values, offsets = arrow_binary(col, field, where, first)
    return view(values, offsets, len(col), spec, field, where, first)
