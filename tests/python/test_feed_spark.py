"""The data feed on real Spark: DataFrames as named columns through Arrow,
epochs without re-running the lineage, bad input named precisely."""

from __future__ import annotations

import collections

import pytest

import nodefuns
from conftest import read_json_files
from ember.spark import InputMode, run


def _frame(spark, n, parts):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import (ArrayType, FloatType, IntegerType, LongType, StringType,
                                   StructField, StructType)

    rows = [(i, [i * 0.5] * 4, i % 10, f"r{i}", Vectors.dense([float(i), 1.0]))
            for i in range(n)]
    schema = StructType([StructField("id", LongType()), StructField("image", ArrayType(FloatType())),
                         StructField("label", IntegerType()), StructField("name", StringType()),
                         StructField("vec", VectorUDT())])
    return spark.createDataFrame(rows, schema).repartition(parts)


def _feed_frame_twice(spark, df, n, out):
    """Feeds ``df`` (made by _frame) for 2 epochs; checks every id arrived twice
    with every column equal to what the id implies, in _frame's layout."""
    cluster = run(spark.sparkContext, nodefuns.collect_columns, {"out": str(out)},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        assert cluster.train(df, num_epochs=2) == 2 * n
    finally:
        cluster.shutdown(timeout=60)
    infos = read_json_files(str(out))
    got = collections.Counter(i for info in infos for i in info["ids"])
    assert got == collections.Counter({i: 2 for i in range(n)})
    for info in infos:
        assert info["bad"] == []
        assert info["layout"] == {"id": ["int64", []], "image": ["float32", [4]],
                                  "label": ["int32", []], "name": ["list", []],
                                  "vec": ["float64", [2]]}


def test_dataframe_arrives_as_named_columns(local_spark, tmp_path):
    _feed_frame_twice(local_spark, _frame(local_spark, 3000, 5), 3000, tmp_path)


def test_epochs_run_the_lineage_once(local_spark, tmp_path):
    sc = local_spark.sparkContext
    computed = sc.accumulator(0)

    def touch(i):
        computed.add(1)
        return (i, [float(i)])

    rdd = sc.parallelize(range(2000), 4).map(touch)
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        assert cluster.train(rdd, num_epochs=3) == 6000
    finally:
        cluster.shutdown(timeout=60)
    assert computed.value == 2000  # not 6000: the epochs read a cached copy
    assert not rdd.getStorageLevel().useMemory  # and it was unpersisted after
    got = collections.Counter(i for info in read_json_files(str(tmp_path)) for i in info["ids"])
    assert got == collections.Counter({i: 3 for i in range(2000)})


@pytest.mark.parametrize("case, message", [
    ("null", "column 'x' has a null at row"),
    ("ragged", "column 'v' has arrays of different lengths"),
    ("nested", "column 'm' has Arrow type"),
])
def test_dataframe_bad_input_names_the_column(local_spark, tmp_path, case, message):
    spark = local_spark
    if case == "null":
        df = spark.createDataFrame([(1, 1.0), (2, None), (3, 3.0)], "id long, x double")
    elif case == "ragged":
        df = spark.createDataFrame([(1, [1.0, 2.0]), (2, [1.0])], "id long, v array<double>")
    else:
        df = spark.createDataFrame([(1, {"a": 1})], "id long, m map<string,int>")
    df = df.coalesce(1)
    cluster = run(spark.sparkContext, nodefuns.count_records, {"out": str(tmp_path)},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        with pytest.raises(Exception) as err:
            cluster.train(df)
        assert message in str(err.value) and "partition 0" in str(err.value)
    finally:
        cluster._stop_all()


def test_uneven_partitions_do_not_deadlock_synchronous_training(local_spark, tmp_path):
    """Node 0 is fed 9x more records than node 1.  Under MultiWorkerMirroredStrategy
    the main job's loop agrees, inside each step's all-reduce, whether every
    worker has another batch; both stop at the step where node 1 ran out
    (7 batches of 32 from 200 records), and node 0 drains the rest."""
    import argparse

    import numpy as np
    from examples.fashion_mnist import data, model
    from pyspark.sql.types import ArrayType, FloatType, LongType, StructField, StructType

    spark = local_spark
    images, labels = data.load_split("train")
    rows = [((images[i].reshape(-1) / 255.0).astype(np.float32).tolist(), int(labels[i]))
            for i in range(2000)]
    schema = StructType([StructField("image", ArrayType(FloatType())),
                         StructField("label", LongType())])
    # partition p feeds node p % 2: 1800 records to node 0, 200 to node 1
    skewed = spark.sparkContext.parallelize([rows[:1800], rows[1800:]], 2).flatMap(lambda r: r)
    df = spark.createDataFrame(skewed, schema)
    assert df.rdd.glom().map(len).collect() == [1800, 200]
    args = argparse.Namespace(batch_size=32, learning_rate=1e-3, epochs=1, train_records=2000,
                              model_dir=str(tmp_path / "model"), export_dir=str(tmp_path / "export"),
                              intra_op_threads=1, inter_op_threads=1)
    cluster = run(spark.sparkContext, model.train_spark, args, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        assert cluster.train(df) == 2000
    finally:
        cluster.shutdown(timeout=300)
    import tensorflow as tf

    final = tf.train.latest_checkpoint(str(tmp_path / "model" / "checkpoint"))
    assert final is not None and int(final.rsplit("-", 1)[1]) == 7


def test_node_without_a_partition_stops_instead_of_waiting(local_spark, tmp_path):
    """One partition for two nodes: node 1 gets none, so its feed is ended and
    its main_fun returns; node 0 gets everything."""
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        assert cluster.train(sc.parallelize([(i, [1.0]) for i in range(500)], 1)) == 500
    finally:
        cluster.shutdown(timeout=60)
    ids = {info["index"]: info["ids"] for info in read_json_files(str(tmp_path))}
    assert sorted(ids[0]) == list(range(500)) and ids[1] == []


def test_tensor_columns_arrive_as_the_arrays_they_pack(local_spark, tmp_path):
    """ember.tensors.pack stores image as packed float32 bytes; the node gets
    the same (rows, 4) float32 arrays the array column gives, over 2 epochs
    (the metadata survives the epochs' union)."""
    from ember import tensors

    df = _frame(local_spark, 1000, 3)
    packed = tensors.pack(df, {"image": (4,)}).cache()
    assert packed.schema["image"].dataType.typeName() == "binary"
    assert tensors.tensor_specs(packed.schema)["image"][1] == (4,)
    try:
        _feed_frame_twice(local_spark, packed, 1000, tmp_path)
    finally:
        packed.unpersist()


def test_tensor_column_shapes_and_truncated_values():
    """The feed's view of a packed column: a 2x2 shape arrives as (rows, 2, 2)
    without a copy; a value of the wrong length is named by column and row."""
    import numpy as np
    import pyarrow as pa

    from ember import _columns, tensors

    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    col = tensors._pack_column(pa.array(x.tolist(), pa.list_(pa.float64())), "m", "<f8", (2, 2),
                               where="test")
    spec = {"m": (np.dtype("<f8"), (2, 2))}
    (name, _, width, view, _), = _columns.arrow_to_columns(
        pa.RecordBatch.from_arrays([col], names=["m"]), tensors=spec)[0]
    assert (name, width) == ("m|2x2", 4) and view.shape == (3, 2, 2)
    assert np.shares_memory(view, np.frombuffer(col.buffers()[2], dtype=np.uint8))
    np.testing.assert_array_equal(view.reshape(3, 4), x)
    short = pa.array([bytes(32), bytes(24), bytes(32)], pa.binary())
    with pytest.raises(ValueError, match=r"batch: tensor column 'm' row 1 has 24 bytes; "
                                         r"float64\[2, 2\] is 32"):
        _columns.arrow_to_columns(pa.RecordBatch.from_arrays([short], names=["m"]), tensors=spec)


@pytest.mark.parametrize("rows, message", [
    ([(1, [1.0, 2.0]), (2, [1.0])], "column 'v' row 1 has 1 values; its tensor shape (2,) needs 2"),
    ([(1, [1.0, 2.0]), (2, None)], "column 'v' has a null array at row 1"),
])
def test_tensor_pack_bad_rows_name_the_row(local_spark, rows, message):
    from ember import tensors

    df = local_spark.createDataFrame(rows, "id long, v array<double>").coalesce(1)
    with pytest.raises(Exception) as err:
        tensors.pack(df, {"v": (2,)}).collect()
    assert message in str(err.value) and "partition 0" in str(err.value)
    with pytest.raises(TypeError, match="column 'id' is bigint"):
        tensors.pack(df, {"id": (1,)})
