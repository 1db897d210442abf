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
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ember import _ember

#: The single column of a batch whose records are plain values, not tuples.
VALUE_FIELD = ""

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
