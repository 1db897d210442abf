"""ember.tfrecord.save / load with a real Spark session (the shared local one):
round trip of every supported type with nulls, schema inference as TFoS's
dfutil, schema enforcement naming record and field, and no partial part
file after a failed task."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ember.tfrecord as tfr


def _df(spark):
    from pyspark.sql import types as T

    schema = T.StructType([
        T.StructField("id", T.LongType()), T.StructField("i32", T.IntegerType()),
        T.StructField("x", T.DoubleType()), T.StructField("name", T.StringType()),
        T.StructField("blob", T.BinaryType()), T.StructField("flag", T.BooleanType()),
        T.StructField("vec", T.ArrayType(T.FloatType())),
        T.StructField("tags", T.ArrayType(T.StringType())),
    ])
    rows = []
    for i in range(40):
        rows.append((i, -i, i / 4, None if i % 7 == 3 else f"n{i}", bytes([i, 255]), i % 2 == 0,
                     None if i % 5 == 4 else [float(i), -1.5][: i % 3],
                     [f"t{k}" for k in range(i % 4)]))
    return spark.createDataFrame(rows, schema).repartition(3), rows


def test_save_load_round_trip(local_spark, tmp_path):
    df, rows = _df(local_spark)
    out = str(tmp_path / "tfr")
    assert tfr.save(df, out) == 40
    names = sorted(os.listdir(out))
    assert names == ["_SUCCESS", "part-00000.tfrecord", "part-00001.tfrecord",
                     "part-00002.tfrecord"]
    with pytest.raises(FileExistsError):
        tfr.save(df, out)

    # with the writer's schema: identical rows
    back = tfr.load(local_spark, out, df.schema)
    got = sorted((tuple(r) for r in back.collect()), key=lambda r: r[0])
    want = [(i, i32, x, name, blob, flag, vec if vec is None or vec else [], tags)
            for (i, i32, x, name, blob, flag, vec, tags) in rows]
    for g, w in zip(got, want):
        # an empty array reads back as an empty array; a null one as null
        assert g[:6] == (w[0], w[1], w[2], w[3], bytearray(w[4]), w[5])
        assert g[6] == w[6] and g[7] == w[7]
    assert len(got) == 40

    # inferred: long / float / string / binary; arrays where a record has != 1 value
    inferred = tfr.infer_schema(out)
    types = {f.name: f.dataType.simpleString() for f in inferred.fields}
    assert types == {"blob": "binary", "flag": "bigint", "i32": "bigint", "id": "bigint",
                     "name": "string", "tags": "array<string>", "vec": "array<float>",
                     "x": "float"}
    df2 = tfr.load(local_spark, out)
    assert df2.count() == 40 and df2.schema == inferred


def test_schema_enforcement_names_record_and_field(local_spark, tmp_path):
    out = str(tmp_path / "e")
    tfr.write(os.path.join(out, "part-00000.tfrecord") if os.makedirs(out) is None else "",
              {"label": np.array([1, 2, 3]), "vec": np.ones((3, 2), np.float32)})
    with pytest.raises(Exception, match=r"part-00000.tfrecord: record 0 \(byte offset 0\): "
                                        r"feature 'label': expected float_list, found int64_list"):
        tfr.load(local_spark, out, "label float, vec array<float>").collect()
    with pytest.raises(Exception, match=r"part-00000.tfrecord: record 0: field 'vec': 2 values "
                                        r"for the scalar type float"):
        tfr.load(local_spark, out, "label long, vec float").collect()
    with pytest.raises(Exception, match=r"record 0: field 'gone': missing, but the schema says "
                                        "not nullable"):
        from pyspark.sql import types as T
        s = T.StructType([T.StructField("gone", T.LongType(), False)])
        tfr.load(local_spark, out, s).collect()
    ok = tfr.load(local_spark, out, "label int, vec array<double>").collect()
    assert [r.label for r in ok] == [1, 2, 3] and ok[0].vec == [1.0, 1.0]


def test_failed_task_leaves_no_partial_file(local_spark, tmp_path):
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    @F.udf(LongType())
    def boom(i):
        if i == 25:
            raise ValueError("task fails on purpose")
        return i

    df = local_spark.range(0, 30, 1, numPartitions=2).select(boom("id").alias("id"))
    out = str(tmp_path / "f")
    with pytest.raises(Exception, match="task fails on purpose"):
        tfr.save(df, out)
    parts = [n for n in os.listdir(out) if n.startswith("part-")]
    assert "_SUCCESS" not in os.listdir(out)
    for n in parts:  # whatever is visible is whole: partition 0 (ids 0..14)
        assert [int(x) for b in tfr.reader(os.path.join(out, n), 100, {"id": "int64"})
                for x in b["id"]] == list(range(15))
    assert "part-00001.tfrecord" not in parts
