"""TensorFlowOnSpark's ``dfutil`` on Ember's C TFRecord/Example codec.

TFoS needed TensorFlow's Hadoop jar (``tensorflow-hadoop``) on the classpath
for ``saveAsTFRecords``/``loadTFRecords`` and TensorFlow's protobuf classes for
the conversions; here both go through ``ember.tfrecord`` and ``_ember``'s
Example encoder/decoder: no jar, no TensorFlow import.

Type mapping is TFoS's: float/double -> FloatList, integers and booleans ->
Int64List, string/binary -> BytesList, arrays of those -> lists; when reading,
int64 -> long, float -> double, bytes -> string (binary for ``binary_features``),
an array type when the first record holds other than one value.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import numpy as np

from ember import _ember, tfrecord

loadedDF: Dict[Any, str] = {}  #: DataFrames made by loadTFRecords -> their path

_FLOAT = ("float", "double")
_INT = ("boolean", "tinyint", "smallint", "int", "bigint", "long")
_BYTES = ("binary", "string")
_FLOAT_LIST = ("array<float>", "array<double>")
_INT_LIST = tuple(f"array<{t}>" for t in _INT)


def isLoadedDF(df: Any) -> bool:
    """True if ``df`` was made by :func:`loadTFRecords`."""
    return df in loadedDF


def saveAsTFRecords(df: Any, output_dir: str) -> int:
    """Writes ``df`` as TFRecord files of tf.train.Example (one part file per
    partition) under ``output_dir``, which must not exist or be empty.
    Returns the number of records written."""
    for name, dtype in df.dtypes:
        if dtype not in _FLOAT + _INT + _BYTES + _FLOAT_LIST + _INT_LIST:
            raise Exception(f"Unsupported dtype: {dtype} (column {name!r})")
    return tfrecord.save(df, output_dir)


def loadTFRecords(sc: Any, input_dir: str, binary_features: Sequence[str] = []) -> Any:  # noqa: B006
    """A DataFrame of the tf.train.Example records under ``input_dir``, its schema
    inferred (TFoS's way) from the first record; ``binary_features`` become
    BinaryType instead of StringType."""
    from pyspark.sql import SparkSession

    files = tfrecord.list_files(input_dir)
    first = None
    for f in files:
        with tfrecord.open_reader(f) as r:
            for rec in r:
                first = bytes(rec)
                break
        if first is not None:
            break
    if first is None:
        raise ValueError(f"no records in the TFRecord files under {input_dir}")
    schema = infer_schema(first, binary_features)
    spark = SparkSession.builder.getOrCreate() if SparkSession.getActiveSession() is None \
        else SparkSession.getActiveSession()
    df = tfrecord.load(spark, files, schema)
    loadedDF[df] = input_dir
    return df


def _serialized(example: Any) -> bytes:
    if isinstance(example, (bytes, bytearray, memoryview)):
        return bytes(example)
    if hasattr(example, "SerializeToString"):
        return example.SerializeToString()
    raise TypeError(f"expected a tf.train.Example or its serialized bytes, got "
                    f"{type(example).__name__}")


def _count(kind: int, vals: Any) -> int:
    if kind == tfrecord.FLOAT:
        return len(vals) // 4
    if kind == tfrecord.INT64:
        return len(vals) // 8
    return len(vals)


def infer_schema(example: Any, binary_features: Sequence[str] = []) -> Any:  # noqa: B006
    """The Spark StructType of one tf.train.Example (object or serialized bytes), TFoS's
    way: int64 -> LongType, float -> DoubleType, bytes -> StringType (BinaryType for
    ``binary_features``), ArrayType when there is more than one value; sorted by name."""
    from pyspark.sql.types import (ArrayType, BinaryType, DoubleType, LongType, StringType,
                                   StructField, StructType)

    fields = []
    for name, (kind, vals) in sorted(_ember.example_parse(_serialized(example)).items()):
        if name in binary_features:
            fields.append(StructField(name, BinaryType(), True))
            continue
        base = {tfrecord.INT64: LongType(), tfrecord.FLOAT: DoubleType()}.get(kind, StringType())
        fields.append(StructField(name, ArrayType(base) if _count(kind, vals) > 1 else base, True))
    return StructType(fields)


def fromTFExample(iter: Iterable[Any], binary_features: Sequence[str] = []) -> List[Any]:  # noqa: A002,B006
    """mapPartitions function: serialized Examples (``(bytes, None)`` pairs as TFoS's
    Hadoop reader gave, or plain bytes) -> Rows, a column per feature."""
    from pyspark.sql import Row

    rows = []
    for record in iter:
        data = record[0] if isinstance(record, tuple) else record
        d: Dict[str, Any] = {}
        for name, (kind, vals) in sorted(_ember.example_parse(bytes(data)).items()):
            if kind == tfrecord.INT64:
                values: List[Any] = np.frombuffer(vals, "<i8").tolist()
            elif kind == tfrecord.FLOAT:
                values = np.frombuffer(vals, "<f4").tolist()
            else:
                if not vals:
                    d[name] = None
                elif name in binary_features:
                    d[name] = bytearray(vals[0])
                else:
                    d[name] = bytes(vals[0]).decode("utf-8")
                continue
            d[name] = values if len(values) > 1 else (values[0] if values else None)
        rows.append(Row(**d))
    return rows


def toTFExample(dtypes: Sequence[Any]) -> Any:
    """mapPartitions function: Rows of a DataFrame with ``dtypes`` -> ``(bytearray, None)``
    pairs of serialized tf.train.Example (TFoS's record form), encoded in C."""
    plan = []
    for name, dtype in dtypes:
        if dtype in _FLOAT or dtype in _FLOAT_LIST:
            plan.append((name, tfrecord.FLOAT, dtype in _FLOAT_LIST))
        elif dtype in _INT or dtype in _INT_LIST:
            plan.append((name, tfrecord.INT64, dtype in _INT_LIST))
        elif dtype in _BYTES:
            plan.append((name, tfrecord.BYTES, False))
        else:
            raise Exception(f"Unsupported dtype: {dtype}")

    def _toTFExample(it: Iterable[Any]) -> List[Any]:
        rows = list(it)
        if not rows:
            return []
        cols = [_column(rows, name, kind, is_list) for name, kind, is_list in plan]
        return [(bytearray(b), None) for b in _ember.encode_examples(cols, len(rows))]

    return _toTFExample


def _column(rows: List[Any], name: str, kind: int, is_list: bool) -> Any:
    vals = [r[name] for r in rows]
    present = np.array([v is not None for v in vals], dtype=np.uint8)
    if kind == tfrecord.BYTES:
        enc = [b"" if v is None else (bytes(v) if isinstance(v, (bytes, bytearray))
                                      else str(v).encode("utf-8")) for v in vals]
        offsets = np.zeros(len(enc) + 1, dtype=np.uint64)
        np.cumsum([len(b) for b in enc], out=offsets[1:])
        return (name, kind, 1, b"".join(enc), offsets, None, present)
    dt = np.float32 if kind == tfrecord.FLOAT else np.int64
    if not is_list:
        arr = np.array([0 if v is None else v for v in vals], dtype=dt)
        return (name, kind, 1, arr, None, None, present)
    lens = [0 if v is None else len(v) for v in vals]
    roff = np.zeros(len(vals) + 1, dtype=np.uint64)
    np.cumsum(lens, out=roff[1:])
    flat = np.array([x for v in vals if v is not None for x in v], dtype=dt)
    return (name, kind, 0, flat, None, roff, present)
