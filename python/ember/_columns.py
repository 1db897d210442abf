"""Records <-> columnar batches, the shapes that cross Ember's data feed.

A batch on the wire is a set of contiguous columns (see ``ember/feed.h``).  This
module turns a chunk of Spark records into such columns (in one C call per
chunk for the common record shapes, ``_ember.records_to_columns``; otherwise
with numpy, one vectorised conversion per field) and turns a received batch
back into zero-copy numpy views.

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

import collections.abc
import functools
import numbers
import pickle
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ember import _ember
from ember import tensors as tensors_mod
from ember.errors import EmberFeedError

#: The single column of a batch whose records are plain values, not tuples.
VALUE_FIELD = ""

_NUMPY_TO_DT: Dict[np.dtype[Any], int] = {
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


def unpickled(records: Any) -> List[Any]:
    """The records of ``_ember.PickledRecords``, or of a tuple of them (the
    parts of a chunk), as Python objects; a list is returned as it is."""
    if isinstance(records, list):
        return records
    if isinstance(records, _ember.PickledRecords):
        return pickle.loads(records.frame)[records.start:records.stop]
    return [r for part in records for r in unpickled(part)]


def records_in(records: Any) -> int:
    """The records of a chunk: a list, ``_ember.PickledRecords`` or a tuple of them."""
    return sum(len(p) for p in records) if isinstance(records, tuple) else len(records)


def _pickled_fields(records: Any) -> Optional[List[str]]:
    """:func:`_record_fields` of ``_ember.PickledRecords`` or a tuple of them
    (plain tuples or bare values; every part has the first one's fields, or
    the C path hands the chunk to Python)."""
    first = records[0] if isinstance(records, tuple) else records
    return None if first.fields is None else [str(i) for i in range(first.fields)]


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
        raise EmberFeedError(f"{where}: field {field!r} mixes text/bytes with other "
                             "types") from exc
    offsets = np.zeros(len(encoded) + 1, dtype=np.uint64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = b"".join(encoded)
    return (_encode_name(field, (), is_str), _ember.DT_BYTES, 0, data, offsets)


def array_column(field: str, array: np.ndarray, where: str = "batch") -> ColumnSpec:
    """A column from an array whose first axis is the row axis."""
    array = np.asarray(array)
    if array.ndim == 0:
        raise EmberFeedError(f"{where}: field {field!r} is a scalar, expected one value per row")
    if array.dtype.kind in "US":
        return _bytes_column(array.tolist(), field, where)
    dt = _NUMPY_TO_DT.get(array.dtype)
    if dt is None:
        if array.dtype.kind == "f":
            array, dt = array.astype(np.float64), _ember.DT_F64
        elif array.dtype.kind in "iu":
            array, dt = array.astype(np.int64), _ember.DT_I64
        else:
            raise EmberFeedError(f"{where}: field {field!r} has unsupported dtype {array.dtype}")
    row_shape = array.shape[1:]
    width = int(np.prod(row_shape)) if row_shape else 1
    array = np.ascontiguousarray(array)
    return (_encode_name(field, row_shape, False), dt, width, array, None)


# ----------------------------------------------- every record of a column agrees
# A column is one numpy array (or one bytes column) on the wire, so its records
# must agree: numbers with numbers (int and float mixed become float64), str
# with str, bytes with bytes, arrays with arrays of the same shape.  The check
# costs one type lookup per distinct type in the common case; only a chunk that
# disagrees is scanned record by record, to name the first record that does.

_NUMBERS = ("int", "float")
_FEEDABLE = ("int", "float", "bool", "str", "bytes", "array")


def _type_kind_uncached(t: type) -> str:
    """The feed's kind of values of type t: int, float, bool, str, bytes, array,
    null, or the type's name when the feed does not carry it."""
    if t is type(None):
        return "null"
    if issubclass(t, (bool, np.bool_)):
        return "bool"
    if issubclass(t, numbers.Integral):
        return "int"
    if issubclass(t, numbers.Real):
        return "float"
    if issubclass(t, str):
        return "str"
    if issubclass(t, (bytes, bytearray, memoryview)):
        return "bytes"
    if issubclass(t, (list, tuple, np.ndarray)) or hasattr(t, "__array__") or \
            (hasattr(t, "__len__") and hasattr(t, "__getitem__") and
             not issubclass(t, collections.abc.Mapping)):
        return "array"  # what numpy takes as one: Spark ML vectors (dense and sparse)...
    return t.__name__


#: _type_kind_uncached, cached per type.  Declared a plain Callable because
#: mypy types lru_cache's wrapper as taking Hashable arguments and does not
#: count class objects as Hashable.
_type_kind: Callable[[type], str] = functools.lru_cache(maxsize=256)(_type_kind_uncached)


def _short(v: Any) -> str:
    """A one-line repr of a value, at most 40 characters."""
    r = " ".join(repr(v).split())
    return r if len(r) <= 40 else r[:37] + "..."


def _shape(v: Any) -> Optional[Tuple[int, ...]]:
    """The shape of an array value, None when its nested lists are ragged."""
    if isinstance(v, np.ndarray):
        return tuple(v.shape)
    try:
        return tuple(np.shape(v))
    except ValueError:
        return None


def _is_value(v: Any, kind: str) -> str:
    """'is str ('cat')', 'is None', 'is an array of shape (2,)'."""
    if kind == "null":
        return "is None"
    if kind == "array":
        shape = _shape(v)
        return "is a ragged array" if shape is None else f"is an array of shape {shape}"
    return f"is {kind} ({_short(v)})"


def _column_label(j: int, field: str) -> str:
    if field == VALUE_FIELD:
        return ""
    return f"column {j}: " if field == str(j) else f"column {j} ({field!r}): "


def _disagreeing_kind(values: List[Any], label: str, where: str, first: int,
                      ref: Tuple[str, Any]) -> EmberFeedError:
    """The error naming the first value whose kind disagrees with ref's."""
    kind, shape = ref
    earlier = f"are arrays of shape {shape}" if kind == "array" else f"are {kind}"
    for i, v in enumerate(values):
        k = _type_kind(type(v))
        if k != kind and not (k in _NUMBERS and kind in _NUMBERS):
            return EmberFeedError(f"{where}: {label}record {first + i} {_is_value(v, k)}, "
                                  f"earlier records {earlier}")
    return EmberFeedError(f"{where}: {label}records disagree in type")  # not reached


def _disagreeing_array(values: List[Any], label: str, where: str, first: int,
                       shape: Optional[Tuple[int, ...]]) -> EmberFeedError:
    """The error naming the first array value of another shape, or holding a
    value that is not a number."""
    for i, v in enumerate(values):
        s = _shape(v)
        if s is None or s != shape:
            what = "is a ragged array" if s is None else f"has shape {s}"
            return EmberFeedError(f"{where}: {label}record {first + i} {what}, "
                                  f"earlier records have shape {shape}")
        a = np.asarray(v) if not isinstance(v, (list, tuple)) else np.asarray(v, dtype=object)
        if a.dtype.kind not in "biuf":
            for at, x in np.ndenumerate(a):
                x = x.item() if isinstance(x, np.generic) else x
                k = _type_kind(type(x))
                if k not in _NUMBERS and k != "bool":
                    element = at[0] if len(at) == 1 else at
                    return EmberFeedError(f"{where}: {label}record {first + i}, element "
                                          f"{element} {_is_value(x, k)}; arrays hold numbers "
                                          "only" + (", fill or drop nulls before feeding"
                                                    if k == "null" else ""))
    return EmberFeedError(f"{where}: {label}records do not form one numeric array")


def _field_column(values: List[Any], j: int, field: str, where: str, first: int,
                  ref: Optional[Tuple[str, Any]]) -> Tuple[ColumnSpec, Tuple[str, Any]]:
    """One column of a chunk's records, checked against ``ref`` (kind, array
    shape) of the partition's earlier chunks, or of this chunk's first record.
    Returns the column and the reference for the next chunk."""
    label = _column_label(j, field)
    if ref is None:
        v0 = values[0]
        k0 = _type_kind(type(v0))
        if k0 == "null":
            raise EmberFeedError(f"{where}: {label}record {first} is None; fill or drop nulls "
                                 "before feeding")
        if k0 not in _FEEDABLE:
            raise EmberFeedError(f"{where}: {label}record {first} is {k0} ({_short(v0)}); the "
                                 "feed carries numbers, str, bytes and arrays of numbers")
        ref = (k0, _shape(v0) if k0 == "array" else None)
        if k0 == "array" and ref[1] is None:
            raise EmberFeedError(f"{where}: {label}record {first} is a ragged array; the feed "
                                 "carries arrays of one shape per column")
    kind, shape = ref
    for t in set(map(type, values)):
        k = _type_kind(t)
        if k != kind and not (k in _NUMBERS and kind in _NUMBERS):
            raise _disagreeing_kind(values, label, where, first, ref)
    if kind in ("str", "bytes"):
        return _bytes_column(values, field, where), ref
    try:
        array = np.stack(values) if isinstance(values[0], np.ndarray) else np.asarray(values)
    except ValueError:  # ragged
        array = None
    if kind == "array":
        if array is None or array.dtype.kind not in "biuf" or tuple(array.shape[1:]) != shape:
            raise _disagreeing_array(values, label, where, first, shape)
    elif array is None or array.dtype.kind not in "biuf":  # e.g. an int beyond int64
        raise EmberFeedError(f"{where}: {label}records {first}..{first + len(values) - 1} do "
                             "not fit one numeric type (int64, float64 or bool)")
    return array_column(field, array, where), ref


# ------------------------------------------------ the C fast path (one call a chunk)
# _ember.records_to_columns converts the record shapes Spark jobs feed in bulk
# straight into the columns' buffers; it returns None for anything it does not
# convert exactly as the Python path below (other types, a disagreement, a None,
# a ragged array, an int beyond int64...), which then converts the chunk or
# raises the error naming the record: the wording has this one source.


#: numpy type character the fast path reports -> (numpy dtype, feed dtype)
_FAST_DTYPES = {c: (np.dtype(c), _NUMPY_TO_DT[np.dtype(c)]) for c in "fdilB?"}


def _records_to_columns_c(records: List[Any], fields: Optional[List[str]],
                          refs: Optional[List[Any]]
                          ) -> Optional[Tuple[List[ColumnSpec], List[Any]]]:
    """(column specs, refs for the next chunk) from the C fast path, or None."""
    out = _ember.records_to_columns(records, fields, refs)
    if out is None:
        return None
    cols, new_refs = out
    specs: List[ColumnSpec] = []
    for col in cols:
        if col[1] is None:  # str/bytes: the joined bytes and n + 1 offsets
            name, _, _, joined, offsets, _ = col
            specs.append((name, _ember.DT_BYTES, 0, joined,
                          np.frombuffer(offsets, dtype=np.uint64)))
        else:
            name, char, width, data, _, shape = col
            dtype, dt = _FAST_DTYPES[char]
            specs.append((name, dt, width, np.frombuffer(data, dtype=dtype).reshape(shape), None))
    return specs, new_refs


def records_to_columns(records: Any, where: str = "batch", first: int = 0,
                       layout: Optional[Dict[str, Any]] = None
                       ) -> Tuple[List[ColumnSpec], int]:
    """Converts a chunk of records (a list, or one array with a row axis) to columns.

    Returns (column specs for ``_ember`` encoders, row count).  Every record of
    a column must agree with the first: numbers (int and float mixed are
    promoted to float64), ``str``, ``bytes``, or arrays of one shape.  Raises
    :class:`ember.errors.EmberFeedError` naming the column, the record (its
    index ``first + i``: ``first`` is the index of ``records[0]`` in its
    partition) and both types or shapes, e.g. ``feeding partition 3: column 1
    ('label'): record 17 is str ('cat'), earlier records are int``.

    ``layout``: a dict the caller keeps across the chunks of one partition;
    the first chunk records each column's kind and shape in it, and a later
    chunk that disagrees is named the same way.

    The chunk is converted in one C call (``_ember.records_to_columns``) when
    its records are of the common shapes; otherwise, and to name an error, by
    :func:`_records_to_columns_py`, with the same result.
    """
    if not isinstance(records, np.ndarray):
        records = records if isinstance(records, list) else list(records)
    if isinstance(records, list) and records:
        if layout is None:
            layout = {}
        if "fields" not in layout:
            layout["fields"] = _record_fields(records[0])
        fast = _records_to_columns_c(records, layout["fields"], layout.get("refs"))
        if fast is not None:
            specs, layout["refs"] = fast
            return specs, len(records)
    return _records_to_columns_py(records, where, first, layout)


def send_records(client: Any, records: Any, where: str, first: int,
                 layout: Dict[str, Any], timeout: float) -> Tuple[int, int]:
    """Sends a chunk of records (a list, or ``_ember.PickledRecords`` or a
    tuple of them: see :func:`ember._grouping.frame_chunks`) as one batch on a
    feed client; returns
    (records sent, bytes of their columns, 0 when unknown).  When the C path
    takes the chunk, its columns are written straight into the batch's place
    in the ring (``FeedClient.send_records``: no copy of them in between);
    otherwise :func:`records_to_columns`'s Python path converts it, or raises
    its error, and ``client.send`` sends it.  ``where``, ``first`` and
    ``layout`` are records_to_columns'."""
    if len(records):
        if "fields" not in layout:
            layout["fields"] = _record_fields(records[0]) if isinstance(records, list) \
                else _pickled_fields(records)
        done = client.send_records(records, layout["fields"], layout.get("refs"), timeout)
        if done is not None:
            layout["refs"], nbytes = done
            return records_in(records), nbytes
    cols, n = _records_to_columns_py(unpickled(records), where, first, layout)
    client.send(cols, n, timeout)
    return n, 0


def rows_in_place(room: int, rows: int, n: int, nbytes: int) -> int:
    """Records for a partition's next chunk: at most ``rows``, and few enough
    that their batch (``nbytes`` for the ``n`` records of the last one) takes
    at most 3/4 of ``room``, the largest batch written in place in the ring
    (``FeedClient.in_place_max``; 0: not a ring).  So each batch is written
    straight into the ring, and the node reads one while the next is written.
    """
    target = room * 3 // 4
    if room <= 0 or n <= 0 or nbytes <= target:
        return rows
    return max(1, min(rows, n * target // nbytes))


def _records_to_columns_py(records: Any, where: str = "batch", first: int = 0,
                           layout: Optional[Dict[str, Any]] = None
                           ) -> Tuple[List[ColumnSpec], int]:
    """:func:`records_to_columns` in Python, record by record (same arguments,
    result, errors and ``layout``): the reference for the C fast path, and the
    path that converts the rarer types and words every error."""
    if isinstance(records, np.ndarray):
        return [array_column(VALUE_FIELD, records, where)], int(records.shape[0])
    records = records if isinstance(records, list) else list(records)
    n = len(records)
    if n == 0:
        return [], 0
    if layout is None:
        layout = {}
    if "fields" not in layout:
        layout["fields"] = _record_fields(records[0])
    fields: Optional[List[str]] = layout["fields"]
    if fields is None:
        names, columns = [VALUE_FIELD], [records]
    else:
        width = len(fields)
        for i, rec in enumerate(records):
            if not isinstance(rec, (tuple, list)):
                raise EmberFeedError(f"{where}: record {first + i} "
                                     f"{_is_value(rec, _type_kind(type(rec)))}, earlier "
                                     f"records have {width} fields")
            if len(rec) != width:
                raise EmberFeedError(f"{where}: record {first + i} has {len(rec)} fields, "
                                     f"earlier records have {width}")
        names, columns = fields, [[r[j] for r in records] for j in range(width)]
    refs = layout.get("refs") or [None] * len(names)
    specs = []
    for j, (name, values) in enumerate(zip(names, columns)):
        spec, refs[j] = _field_column(values, j, name, where, first, refs[j])
        specs.append(spec)
    layout["refs"] = refs
    return specs, n


def row_shape(shape: Optional[Tuple[int, ...]], width: int) -> Tuple[int, ...]:
    """The shape of one row of a fixed-width column: the shape its name
    carries, else a scalar for width 1 and a vector otherwise."""
    if shape is not None:
        return shape
    return () if width == 1 else (width,)


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
            col = col.reshape((n,) + row_shape(shape, width))
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
# Rows are named by their index in the feeding task's partition: ``first`` is
# the index of the batch's first row there.

def _first_null(col: Any) -> int:
    return int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])


def _arrow_values(col: Any, field: str, where: str, first: int = 0) -> np.ndarray:
    """A null-free primitive Arrow array as a numpy view (no copy)."""
    import pyarrow as pa

    if col.null_count:
        raise EmberFeedError(f"{where}: column {field!r}: row {first + _first_null(col)} is "
                             "null; fill or drop nulls before feeding")
    if pa.types.is_boolean(col.type):
        return col.to_numpy(zero_copy_only=False)  # Arrow packs booleans in bits
    return col.to_numpy(zero_copy_only=True)


def _arrow_column(col: Any, field: str, where: str, tensors: Mapping[str, Any],
                  first: int = 0) -> ColumnSpec:
    import pyarrow as pa

    t = col.type
    if field in tensors and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return array_column(field, tensors_mod.arrow_view(col, tensors[field], field, where,
                                                          first), where)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return array_column(field, _arrow_values(col, field, where, first), where)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or \
            pa.types.is_binary(t) or pa.types.is_large_binary(t):
        is_str = pa.types.is_string(t) or pa.types.is_large_string(t)
        data, offs = arrow_binary(col, field, where, first)
        return (_encode_name(field, (), is_str), _ember.DT_BYTES, 0, data, offs.astype(np.uint64))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _arrow_list_column(col, field, where, first)
    if pa.types.is_struct(t) and {f.name for f in t} == {"type", "size", "indices", "values"}:
        return _arrow_vector_column(col, field, where, first)
    raise EmberFeedError(f"{where}: column {field!r} has Arrow type {t}, which the feed does "
                         "not carry (numbers, strings, binary, arrays of numbers, ML vectors)")


def arrow_binary(col: Any, field: str, where: str, first: int = 0) -> Tuple[Any, np.ndarray]:
    """(values, offsets from 0) of a null-free string/binary Arrow array, no copy."""
    import pyarrow as pa

    if col.null_count:
        _arrow_values(col, field, where, first)  # raises, naming the row
    t = col.type
    offsets_type = np.int64 if (pa.types.is_large_string(t) or
                                pa.types.is_large_binary(t)) else np.int32
    offs = np.frombuffer(col.buffers()[1], dtype=offsets_type,
                         count=len(col) + 1, offset=col.offset * np.dtype(offsets_type).itemsize)
    start, end = int(offs[0]), int(offs[-1])
    data = memoryview(col.buffers()[2])[start:end] if end > start else b""
    return data, offs - start


def _arrow_list_column(col: Any, field: str, where: str, first: int = 0) -> ColumnSpec:
    """array<number> rows of one length -> a (rows, width) column."""
    import pyarrow as pa

    if col.null_count:
        _arrow_values(col, field, where, first)
    n = len(col)
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
        rel = np.arange(0, (n + 1) * width, width)
    else:
        offs = col.offsets.to_numpy()
        rel = offs - offs[0]  # a slice's offsets do not start at 0
        lengths = np.diff(offs)
        width = int(lengths[0]) if n else 0
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            raise EmberFeedError(
                f"{where}: column {field!r}: row {first + int(bad[0])} has "
                f"{int(lengths[bad[0]])} values, earlier rows have {width} (the feed carries "
                "one fixed width per column)")
    values = col.flatten()
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise EmberFeedError(f"{where}: column {field!r} is a nested array; flatten it first")
    if values.null_count:
        at = _first_null(values)  # flat index: name its row and its place in the row
        row = int(np.searchsorted(rel, at, side="right")) - 1
        raise EmberFeedError(f"{where}: column {field!r}: row {first + row}, element "
                             f"{at - int(rel[row])} is null; fill or drop nulls before feeding")
    flat = _arrow_values(values, field, where)
    return array_column(field, flat.reshape(n, width), where)


def _arrow_vector_column(col: Any, field: str, where: str, first: int = 0) -> ColumnSpec:
    """Spark ML vectors (VectorUDT: struct<type,size,indices,values>) -> float64 rows."""
    if col.null_count:
        _arrow_values(col, field, where, first)
    kinds = col.field("type").to_numpy(zero_copy_only=False)
    values = col.field("values")
    if (kinds == 1).all():  # all dense: one values array per row
        return _arrow_list_column(values, field, where, first)
    sizes = col.field("size").to_numpy(zero_copy_only=False)
    width = int(sizes[kinds == 0][0])
    out = np.zeros((len(col), width), dtype=np.float64)
    indices = col.field("indices")
    for i in range(len(col)):  # sparse rows: scatter (rare in feeds; no hot path)
        v = np.asarray(values[i].values, dtype=np.float64)
        if kinds[i] == 0:
            if int(sizes[i]) != width:
                raise EmberFeedError(f"{where}: column {field!r}: row {first + i} is a vector "
                                     f"of size {int(sizes[i])}, earlier rows have {width}")
            out[i, np.asarray(indices[i].values, dtype=np.int64)] = v
        elif len(v) != width:
            raise EmberFeedError(f"{where}: column {field!r}: row {first + i} is a vector of "
                                 f"size {len(v)}, earlier rows have {width}")
        else:
            out[i, :] = v
    return array_column(field, out, where)


def arrow_to_columns(batch: Any, where: str = "batch",
                     tensors: Optional[Mapping[str, Any]] = None, first: int = 0,
                     layout: Optional[Dict[str, Any]] = None
                     ) -> Tuple[List[ColumnSpec], int]:
    """Columns (views of the Arrow buffers where the layout allows) of a RecordBatch.

    ``tensors`` ({field: (dtype, shape)}, from :func:`ember.tensors.tensor_specs`)
    names the binary columns that hold packed tensors.  Raises
    :class:`ember.errors.EmberFeedError` naming the column and the row
    (``first`` + its index in the batch: ``first`` is the index of the batch's
    first row in its partition), e.g. ``feeding partition 2: column 'image':
    row 5, element 3 is null``.  ``layout``: a dict the caller keeps across the
    batches of one partition, so an array column whose width changes from one
    batch to the next is named too."""
    specs = [_arrow_column(batch.column(i), name, where, tensors or {}, first)
             for i, name in enumerate(batch.schema.names)]
    if layout is not None and batch.num_rows:
        for name, spec in zip(batch.schema.names, specs):
            width = layout.setdefault(name, spec[2])
            if spec[2] != width:
                raise EmberFeedError(f"{where}: column {name!r}: row {first} has {spec[2]} "
                                     f"values, earlier rows have {width} (the feed carries one "
                                     "fixed width per column)")
    return specs, batch.num_rows
