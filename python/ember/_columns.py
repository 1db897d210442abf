"""Records <-> columnar batches, the shapes that cross Ember's data feed.

A batch on the wire is a set of contiguous columns (see ``ember/feed.h``).  This
module turns a chunk of Spark records into such columns with numpy (one
vectorised conversion per field, not per value on the wire) and turns a
received batch back into zero-copy numpy views.

Record shapes and how they map:

* a ``tuple`` (including ``pyspark.sql.Row``) or a ``list`` holding any
  non-numeric element: one column per field;
* a numpy array or a list of plain numbers: a single vector column;
* a scalar (number, ``str``, ``bytes``): a single column.

Column names carry what the C codec does not: the field name, a row shape with
more than one dimension (``image|28x28``) and whether bytes are ``str``
(``text:str``).  Nothing here is pickled.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ember import _ember
from ember import tensors as tensors_mod

#: The single column of a batch whose records are plain values, not tuples.
VALUE_FIELD = ""

#: A one-row batch a feeding task sends after its partition's data in train():
#: int64 [feed sequence, partition, partitions this node gets in the call].
#: The node's DataFeed consumes it; the trainer never sees it.
PARTITION_END_FIELD = "__ember_partition_end__"


def partition_end_columns(seq: int, partition: int, expected: int) -> List[ColumnSpec]:
    mark = np.array([[seq, partition, expected]], dtype=np.int64)
    return [(PARTITION_END_FIELD, _ember.DT_I64, 3, mark, None)]

_NUMPY_TO_DT = {
    np.dtype(np.float32): _ember.DT_F32,
    np.dtype(np.float64): _ember.DT_F64,
    np.dtype(np.int32): _ember.DT_I32,
    np.dtype(np.int64): _ember.DT_I64,
    np.dtype(np.uint8): _ember.DT_U8,
    np.dtype(np.bool_): _ember.DT_BOOL,
}
DT_TO_NUMPY = {v: k for k, v in _NUMPY_TO_DT.items()}

ColumnSpec = Tuple[str, int, int, Any, Optional[np.ndarray]]


def _encode_name(field: str, row_shape: Tuple[int, ...], is_str: bool) -> str:
    name = field
    if len(row_shape) > 1:
        name += "|" + "x".join(str(d) for d in row_shape)
    if is_str:
        name += ":str"
    if len(name.encode()) > 255:
        raise ValueError(f"field name too long for the feed (255 bytes max): {field!r}")
    return name


def decode_name(name: str) -> Tuple[str, Optional[Tuple[int, ...]], bool]:
    """Splits a wire column name into (field, row shape or None, is_str)."""
    is_str = name.endswith(":str")
    if is_str:
        name = name[:-4]
    shape = None
    if "|" in name:
        name, dims = name.rsplit("|", 1)
        shape = tuple(int(d) for d in dims.split("x"))
    return name, shape, is_str


def _is_plain_number(v: Any) -> bool:
    return isinstance(v, numbers.Number) and not isinstance(v, bool)


def _record_fields(first: Any) -> Optional[List[str]]:
    """Field names when records are tuples of fields, or None for plain values."""
    if isinstance(first, tuple):
        names = getattr(first, "__fields__", None)  # pyspark.sql.Row
        return list(names) if names else [str(i) for i in range(len(first))]
    if isinstance(first, list) and not all(_is_plain_number(v) for v in first):
        return [str(i) for i in range(len(first))]
    return None


def _bytes_column(values: Sequence[Any], field: str, where: str) -> ColumnSpec:
    is_str = isinstance(values[0], str)
    try:
        encoded = [v.encode() if is_str else bytes(v) for v in values]
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"{where}: field {field!r} mixes text/bytes with other types") from exc
    offsets = np.zeros(len(encoded) + 1, dtype=np.uint64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = b"".join(encoded)
    return (_encode_name(field, (), is_str), _ember.DT_BYTES, 0, data, offsets)


def array_column(field: str, array: np.ndarray, where: str = "batch") -> ColumnSpec:
    """A column from an array whose first axis is the row axis."""
    array = np.asarray(array)
    if array.ndim == 0:
        raise ValueError(f"{where}: field {field!r} is a scalar, expected one value per row")
    if array.dtype.kind in "US":
        return _bytes_column(array.tolist(), field, where)
    dt = _NUMPY_TO_DT.get(array.dtype)
    if dt is None:
        if array.dtype.kind == "f":
            array, dt = array.astype(np.float64), _ember.DT_F64
        elif array.dtype.kind in "iu":
            array, dt = array.astype(np.int64), _ember.DT_I64
        else:
            raise TypeError(f"{where}: field {field!r} has unsupported dtype {array.dtype}")
    row_shape = array.shape[1:]
    width = int(np.prod(row_shape)) if row_shape else 1
    array = np.ascontiguousarray(array)
    return (_encode_name(field, row_shape, False), dt, width, array, None)


def _field_column(values: List[Any], field: str, where: str) -> ColumnSpec:
    first = values[0]
    if isinstance(first, (str, bytes, bytearray, memoryview)):
        return _bytes_column(values, field, where)
    try:
        if isinstance(first, np.ndarray):
            array = np.stack(values)
        else:
            array = np.asarray(values)
    except ValueError as exc:
        raise ValueError(f"{where}: field {field!r} has rows of different shapes") from exc
    if array.dtype == object:
        raise TypeError(
            f"{where}: field {field!r} mixes types (first value {first!r}); "
            "every record must have the same field types")
    return array_column(field, array, where)


def records_to_columns(records: Any, where: str = "batch") -> Tuple[List[ColumnSpec], int]:
    """Converts a chunk of records (a list, or one array with a row axis) to columns.

    Returns (column specs for ``_ember`` encoders, row count).  Raises
    ``TypeError``/``ValueError`` naming the field when records disagree.
    """
    if isinstance(records, np.ndarray):
        return [array_column(VALUE_FIELD, records, where)], int(records.shape[0])
    records = records if isinstance(records, list) else list(records)
    n = len(records)
    if n == 0:
        return [], 0
    fields = _record_fields(records[0])
    if fields is None:
        return [_field_column(records, VALUE_FIELD, where)], n
    width = len(fields)
    for i, rec in enumerate(records):
        if len(rec) != width:
            raise ValueError(f"{where}: record {i} has {len(rec)} fields, expected {width}")
    return [_field_column([r[j] for r in records], name, where)
            for j, name in enumerate(fields)], n


def item_columns(item: Any) -> Tuple[List[str], List[Any]]:
    """Zero-copy numpy views (or lists of str/bytes) of a received feed item."""
    names, columns = [], []
    n = item.nrows
    for name, dtype, width, offset, nbytes, offsets_offset in item.columns:
        field, shape, is_str = decode_name(name)
        if dtype == _ember.DT_BYTES:
            offs = np.frombuffer(item, dtype=np.uint64, count=n + 1, offset=offsets_offset)
            raw = memoryview(item)[offset:offset + nbytes]
            values = [bytes(raw[offs[i]:offs[i + 1]]) for i in range(n)]
            col: Any = [v.decode() for v in values] if is_str else values
        else:
            np_dtype = DT_TO_NUMPY[dtype]
            col = np.frombuffer(item, dtype=np_dtype, count=n * width, offset=offset)
            if shape is not None:
                col = col.reshape((n,) + shape)
            elif width != 1:
                col = col.reshape(n, width)
        names.append(field)
        columns.append(col)
    return names, columns


def rows_of(names: Sequence[str], columns: Sequence[Any], start: int, stop: int) -> Iterable[Any]:
    """Yields records start..stop as plain Python values (for Spark RDD output)."""
    def plain(col: Any, i: int) -> Any:
        v = col[i]
        return v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v
    if len(columns) == 1 and names[0] == VALUE_FIELD:
        col = columns[0]
        for i in range(start, stop):
            yield plain(col, i)
    else:
        for i in range(start, stop):
            yield tuple(plain(c, i) for c in columns)


# ------------------------------------------------------------------ Arrow (DataFrames)

def _arrow_values(col: Any, field: str, where: str) -> np.ndarray:
    """A null-free primitive Arrow array as a numpy view (no copy)."""
    import pyarrow as pa

    if col.null_count:
        row = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
        raise ValueError(f"{where}: column {field!r} has a null at row {row}; "
                         "fill or drop nulls before feeding")
    if pa.types.is_boolean(col.type):
        return col.to_numpy(zero_copy_only=False)  # Arrow packs booleans in bits
    return col.to_numpy(zero_copy_only=True)


def _arrow_column(col: Any, field: str, where: str,
                  tensors: Mapping[str, Any]) -> ColumnSpec:
    import pyarrow as pa

    t = col.type
    if field in tensors and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return array_column(field, tensors_mod.arrow_view(col, tensors[field], field, where),
                            where)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return array_column(field, _arrow_values(col, field, where), where)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or \
            pa.types.is_binary(t) or pa.types.is_large_binary(t):
        is_str = pa.types.is_string(t) or pa.types.is_large_string(t)
        data, offs = arrow_binary(col, field, where)
        return (_encode_name(field, (), is_str), _ember.DT_BYTES, 0, data, offs.astype(np.uint64))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _arrow_list_column(col, field, where)
    if pa.types.is_struct(t) and {f.name for f in t} == {"type", "size", "indices", "values"}:
        return _arrow_vector_column(col, field, where)
    raise TypeError(f"{where}: column {field!r} has Arrow type {t}, which the feed does not "
                    "carry (numbers, strings, binary, arrays of numbers, ML vectors)")


def arrow_binary(col: Any, field: str, where: str) -> Tuple[Any, np.ndarray]:
    """(values, offsets from 0) of a null-free string/binary Arrow array, no copy."""
    import pyarrow as pa

    if col.null_count:
        _arrow_values(col, field, where)  # raises, naming the row
    t = col.type
    offsets_type = np.int64 if (pa.types.is_large_string(t) or
                                pa.types.is_large_binary(t)) else np.int32
    offs = np.frombuffer(col.buffers()[1], dtype=offsets_type,
                         count=len(col) + 1, offset=col.offset * np.dtype(offsets_type).itemsize)
    start, end = int(offs[0]), int(offs[-1])
    data = memoryview(col.buffers()[2])[start:end] if end > start else b""
    return data, offs - start


def _arrow_list_column(col: Any, field: str, where: str) -> ColumnSpec:
    """array<number> rows of one length -> a (rows, width) column."""
    import pyarrow as pa

    if col.null_count:
        _arrow_values(col, field, where)
    n = len(col)
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
    else:
        offs = col.offsets.to_numpy()
        lengths = np.diff(offs)
        width = int(lengths[0]) if n else 0
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            raise ValueError(f"{where}: column {field!r} has arrays of different lengths "
                             f"(row 0 has {width}, row {int(bad[0])} has {int(lengths[bad[0]])}); "
                             "the feed carries one fixed width per column")
    values = col.flatten()
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise TypeError(f"{where}: column {field!r} is a nested array; flatten it first")
    flat = _arrow_values(values, field, where)
    return array_column(field, flat.reshape(n, width), where)


def _arrow_vector_column(col: Any, field: str, where: str) -> ColumnSpec:
    """Spark ML vectors (VectorUDT: struct<type,size,indices,values>) -> float64 rows."""
    kinds = col.field("type").to_numpy(zero_copy_only=False)
    values = col.field("values")
    if (kinds == 1).all():  # all dense: one values array per row
        return _arrow_list_column(values, field, where)
    sizes = col.field("size").to_numpy(zero_copy_only=False)
    width = int(sizes[kinds == 0][0])
    out = np.zeros((len(col), width), dtype=np.float64)
    indices = col.field("indices")
    for i in range(len(col)):  # sparse rows: scatter (rare in feeds; no hot path)
        v = np.asarray(values[i].values, dtype=np.float64)
        if kinds[i] == 0:
            out[i, np.asarray(indices[i].values, dtype=np.int64)] = v
        else:
            out[i, :] = v
    return array_column(field, out, where)


def arrow_to_columns(batch: Any, where: str = "batch",
                     tensors: Optional[Mapping[str, Any]] = None) -> Tuple[List[ColumnSpec], int]:
    """Columns (views of the Arrow buffers where the layout allows) of a RecordBatch.

    ``tensors`` ({field: (dtype, shape)}, from :func:`ember.tensors.tensor_specs`)
    names the binary columns that hold packed tensors."""
    return ([_arrow_column(batch.column(i), name, where, tensors or {})
             for i, name in enumerate(batch.schema.names)], batch.num_rows)
