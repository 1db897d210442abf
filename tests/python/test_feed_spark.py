"""The data feed on real Spark: DataFrames as named columns through Arrow,
epochs without re-running the lineage, bad input named precisely."""

from __future__ import annotations

import collections
import os
import re
import time

import numpy as np
import pytest

import nodefuns
from conftest import read_json_files
from ember import _routing
from ember.errors import EmberFeedError
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
    ("null", "feeding partition 0: column 'x': row 1 is null"),
    ("ragged", "feeding partition 0: column 'v': row 1 has 1 values, earlier rows have 2"),
    ("nested", "feeding partition 0: column 'm' has Arrow type"),
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
        with pytest.raises(EmberFeedError) as err:
            cluster.train(df)
        assert str(err.value).startswith(message), str(err.value)
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


_SIZES = (120, 30)  # records of an even (node 0) and an odd (node 1) partition


def _partition_records(idx):
    return [(idx * 1000 + j, [float(idx)]) for j in range(_SIZES[idx % 2])]


def lockstep_epochs(spark, out, kind, parts=24, epochs=3, feed_timeout=30.0):
    """2 nodes consume in lockstep (an all-reduce every step, as under
    MultiWorkerMirroredStrategy) ``epochs`` epochs of ``parts`` small partitions,
    node 1's 4x smaller than node 0's.  Fed one task per partition, node 1 ran
    out first, its freed slot went to the next partition, node 0's, and so on
    until every slot fed node 0, which waited in its all-reduce for node 1:
    every feeding task blocked until the feed timeout.  Fed one task per node,
    each record arrives once per epoch, on its node, well within the timeout."""
    sc = spark.sparkContext
    rdd = sc.parallelize(range(parts), parts).flatMap(_partition_records)
    data = rdd if kind == "rdd" else spark.createDataFrame(rdd, "id long, x array<double>")
    total = sum(_SIZES[i % 2] for i in range(parts))
    cluster = run(sc, nodefuns.lockstep, {"out": str(out), "step_timeout": 4 * feed_timeout},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=120)
    try:
        start = time.monotonic()
        assert cluster.train(data, num_epochs=epochs, feed_timeout=feed_timeout) == \
            epochs * total
        took = time.monotonic() - start
        cluster.shutdown(timeout=60)
    finally:
        cluster._stop_all()
    assert took < feed_timeout, f"train took {took:.0f} s"
    infos = read_json_files(str(out))
    assert sorted(info["index"] for info in infos) == [0, 1]
    for info in infos:
        assert info["errors"] == []
        mine = collections.Counter(i for idx in range(parts) if idx % 2 == info["index"]
                                   for i, _ in _partition_records(idx))
        for epoch in range(epochs):
            got = collections.Counter(i for i, e in zip(info["ids"], info["epochs"])
                                      if e == epoch)
            assert got == mine, (info["index"], epoch)
        assert len(info["ids"]) == epochs * sum(mine.values())
    return took


@pytest.mark.parametrize("kind", ["rdd", "dataframe"])
def test_synchronous_training_never_starves_a_node(local_spark, tmp_path, kind):
    lockstep_epochs(local_spark, tmp_path, kind)


def test_grouped_feed_splits_at_partition_boundaries():
    """A feeding task's view of its node's group: each partition's records in
    turn (unread ones skipped), empty partitions included, and a stream that
    does not match the group's partitions fails instead of misrouting."""
    import pyarrow as pa

    from ember import _grouping as g

    B = g.BOUNDARY
    items = [B, 1, 2, B, B, 3]
    assert [(p, list(r)) for p, r in g.partitions(items, [0, 2, 4])] == \
        [(0, [1, 2]), (2, []), (4, [3])]
    assert [(p, next(r, None)) for p, r in g.partitions(items, [0, 2, 4])] == \
        [(0, 1), (2, None), (4, 3)]
    with pytest.raises(RuntimeError, match="lacks the start of partition 2"):
        list(g.partitions([B, 1], [0, 2]))
    with pytest.raises(RuntimeError, match="holds more than"):
        list(g.partitions([B, 1, B], [0]))
    assert _routing.node_partitions(1, 0, 10, 2) == [1, 3, 5, 7, 9]
    assert _routing.node_partitions(0, 3, 10, 2) == [4, 6, 8]  # a feed resumed at partition 3
    ids = pa.array([0, 0, 2, 2, 2], pa.int32())  # partitions 10 and 12 of the call
    rb = pa.RecordBatch.from_pydict({"x": [1, 2, 3, 4, 5], g.PARTITION_COLUMN: ids})
    got = [(p, [b.to_pydict() for b in r])
           for p, r in g.arrow_partitions([rb], [10, 12, 14], 10)]
    assert got == [(10, [{"x": [1, 2]}]), (12, [{"x": [3, 4, 5]}]), (14, [])]
    with pytest.raises(RuntimeError, match="partition 12 came after 10"):
        list(g.arrow_partitions([rb], [10, 14], 10))


def test_routes_give_each_node_the_partitions_on_its_host():
    """Partitions cached on hosts b, a, a, b for nodes on a and b: each node
    gets the two on its host, in every epoch; a resumed call and the nodes'
    epoch accounting route the same way."""
    a, b = {"a", "10.0.0.1"}, {"b", "10.0.0.2"}
    routes = _routing.local_routes([b, a, a, b], [a, b])
    assert routes == [1, 0, 0, 1]
    assert _routing.node_partitions(0, 0, 12, 2, routes) == [1, 2, 5, 6, 9, 10]
    assert _routing.node_partitions(1, 4, 12, 2, routes) == [4, 7, 8, 11]  # resumed at epoch 1
    assert [_routing.node_share(p, 0, 12, 2, routes) for p in range(4)] == [6, 6, 6, 6]
    for first in range(12):  # the count agrees with the list, from any first partition
        for p in range(first, 12):
            assert _routing.node_share(p, first, 12, 2, routes) == len(_routing.node_partitions(
                _routing.node_of(p, 2, routes), first, 12, 2, routes))
    assert _routing.node_of(6, 2, routes) == 0 and _routing.node_of(6, 2) == 0
    # round-robin already local, or nothing known, or one host for all: no routes
    assert _routing.local_routes([a, b, a, b], [a, b]) is None
    assert _routing.local_routes([set()] * 4, [a, b]) is None
    assert _routing.local_routes([a | b] * 4, [a, b]) is None
    assert _routing.local_routes([a, a, b, b], [a, b]) == [0, 0, 1, 1]
    # shares stay equal: three of four on host a, so one of them goes to b
    assert _routing.local_routes([b, a, a, a], [a, b]) == [1, 0, 0, 1]
    # a count the nodes do not divide keeps round-robin (epochs alternate its extra one)
    assert _routing.local_routes([b, a, a], [a, b]) is None
    # a partition held on two hosts goes where there is room
    assert _routing.local_routes([b, a | b, a, b], [a, b]) == [1, 0, 0, 1]


def test_fewer_task_slots_than_fed_nodes_is_warned(caplog):
    """One feeding task per fed node holds its slot until the node has taken
    its data: with fewer slots, a synchronous job cannot have every node fed."""
    import logging
    from types import SimpleNamespace

    from ember import driver

    caplog.set_level(logging.INFO, logger="ember")
    jvm_sc = SimpleNamespace(
        maxNumConcurrentTasks=lambda profile: 1,
        resourceProfileManager=lambda: SimpleNamespace(defaultResourceProfile=lambda: None))
    sc = SimpleNamespace(_jsc=SimpleNamespace(sc=lambda: jvm_sc))
    driver._warn_few_slots(sc, 1)
    assert caplog.records == []
    driver._warn_few_slots(sc, 2)
    [record] = caplog.records
    assert (record.name, record.levelno) == ("ember.spark", logging.WARNING)
    assert "runs 1 task(s) at once for 2 fed nodes" in record.getMessage() and \
        "at least 2 task slots" in record.getMessage()


def test_grouped_feed_reads_text_files_and_unions(local_spark, tmp_path):
    """Sources PySpark does not pickle (a text file's lines) and unions of
    differently built RDDs reach the grouped feed intact, blank lines included."""
    sc = local_spark.sparkContext
    lines = [str(i) if i % 7 else "" for i in range(300)]
    (tmp_path / "in").mkdir()
    for k in range(3):
        with open(tmp_path / "in" / f"part-{k}.txt", "w") as f:
            f.write("\n".join(lines[k * 100:(k + 1) * 100]) + "\n")
    text = sc.textFile(str(tmp_path / "in"), 3)
    union = sc.union([text.map(lambda ln: (int(ln or -1), [1.0])),
                      sc.parallelize([(1000 + i, [2.0]) for i in range(50)], 2)])
    # the lines straight (the map runs in the feeding task), then a union of
    # 2 epochs (cached, re-pickled)
    for data, epochs, want in [
            (text.map(lambda ln: (len(ln), [0.0])), 1, [len(ln) for ln in lines]),
            (union, 2, 2 * ([int(ln or -1) for ln in lines] + [1000 + i for i in range(50)]))]:
        out = tmp_path / f"out-{epochs}"
        out.mkdir()
        cluster = run(sc, nodefuns.count_records, {"out": str(out)}, num_executors=2,
                      input_mode=InputMode.SPARK, reservation_timeout=60)
        try:
            assert cluster.train(data, num_epochs=epochs) == len(want)
        finally:
            cluster.shutdown(timeout=60)
        got = collections.Counter(i for info in read_json_files(str(out)) for i in info["ids"])
        assert got == collections.Counter(want)


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


def _tensors_made_in_arrow(batches):
    import pyarrow as pa

    from ember import tensors

    for rb in batches:  # _frame's image of id i: [i * 0.5] * 4, as 2x2 float32
        ids = rb.column("id").to_numpy()
        images = np.repeat((ids * 0.5).astype(np.float32)[:, None], 4, axis=1).reshape(-1, 2, 2)
        yield pa.RecordBatch.from_arrays([rb.column("id"), tensors.to_arrow(images)],
                                         names=["id", "image"])


def test_a_tensor_column_made_in_map_in_arrow_is_the_one_pack_makes(local_spark):
    """ember.tensors.to_arrow and declare: a mapInArrow function that makes
    the rows' tensors itself (no array column in the JVM) gives the column
    ember.tensors.pack gives: the same bytes and the same tensor spec."""
    from ember import tensors

    df = _frame(local_spark, 200, 2).select("id", "image")
    packed = tensors.pack(df, {"image": (2, 2)})
    made = tensors.declare(df.select("id").mapInArrow(_tensors_made_in_arrow,
                                                      "id long, image binary"),
                           {"image": (np.float32, (2, 2))})
    assert tensors.tensor_specs(made.schema) == tensors.tensor_specs(packed.schema)
    assert sorted(made.collect()) == sorted(packed.collect())
    with pytest.raises(TypeError, match="column 'id' is bigint; a tensor column is binary"):
        tensors.declare(made, {"id": (np.int64, (1,))})
    with pytest.raises(TypeError, match="dtype bool is not numeric"):
        tensors.declare(made, {"image": (np.bool_, (4,))})


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
    ([(1, [1.0, 2.0]), (2, [1.0, None])], "column 'v' row 1, element 1 is null"),
])
def test_tensor_pack_bad_rows_name_the_row(local_spark, rows, message):
    from ember import tensors

    df = local_spark.createDataFrame(rows, "id long, v array<double>").coalesce(1)
    with pytest.raises(Exception) as err:
        tensors.pack(df, {"v": (2,)}).collect()
    assert message in str(err.value) and "partition 0" in str(err.value)
    with pytest.raises(TypeError, match="column 'id' is bigint"):
        tensors.pack(df, {"id": (1,)})


# ------------------------------------------------------------------ bad input, named exactly

_ROW = None  # pyspark.sql.Row("id", "label"), made on first use


def _labelled(i, label):
    global _ROW
    if _ROW is None:
        from pyspark.sql import Row
        _ROW = Row("id", "label")
    return _ROW(i, label)


@pytest.mark.parametrize("records, message", [
    ([(i, "cat" if i == 17 else i % 10) for i in range(100)],
     "column 1: record 17 is str ('cat'), earlier records are int"),
    ([_labelled(i, "cat" if i == 17 else i % 10) for i in range(100)],
     "column 1 ('label'): record 17 is str ('cat'), earlier records are int"),
    ([(b"a",), (b"b",), ("c",)], "column 0: record 2 is str ('c'), earlier records are bytes"),
    ([(i, [0.5, 1.5] if i != 5 else 3.0) for i in range(10)],
     "column 1: record 5 is float (3.0), earlier records are arrays of shape (2,)"),
    ([(i, 3.0 if i != 5 else [0.5, 1.5]) for i in range(10)],
     "column 1: record 5 is an array of shape (2,), earlier records are float"),
    ([(i, [1.0] * (783 if i == 42 else 784)) for i in range(100)],
     "column 1: record 42 has shape (783,), earlier records have shape (784,)"),
    ([[1.0] * (783 if i == 42 else 784) for i in range(100)],
     "record 42 has shape (783,), earlier records have shape (784,)"),
    ([(i, [1.0, 2.0, None if i == 3 else 3.0]) for i in range(10)],
     "column 1: record 3, element 2 is None"),
    ([(i, [1.0, "x" if i == 3 else 2.0]) for i in range(10)],
     "column 1: record 3, element 1 is str ('x')"),
    ([(i, None if i == 4 else i) for i in range(10)],
     "column 1: record 4 is None, earlier records are int"),
    ([(i, True if i != 2 else 1) for i in range(10)],
     "column 1: record 2 is int (1), earlier records are bool"),
    ([(1, 2), 5], "record 1 is int (5), earlier records have 2 fields"),
    ([(1, 2), (1, 2, 3)], "record 1 has 3 fields, earlier records have 2"),
])
def test_records_that_disagree_name_column_record_and_both_types(records, message):
    """Every record of a column agrees with the first, or the error names the
    column, the record (by its index in the partition) and both types or shapes."""
    from ember import _columns

    with pytest.raises(EmberFeedError) as err:
        _columns.records_to_columns(records, where="feeding partition 3")
    assert str(err.value).startswith(f"feeding partition 3: {message}"), str(err.value)
    # records are named by their index in the partition, not in the chunk
    with pytest.raises(EmberFeedError, match=r"record 1\d\d\d"):
        _columns.records_to_columns(records, where="feeding partition 3", first=1000)


def test_ints_and_floats_mix_into_float64_and_chunks_agree():
    """int and float records of one column become float64 (documented); a later
    chunk of the same partition must agree with the first one's types."""
    import numpy as np

    from ember import _columns

    (_, _, _, ids, _), (_, _, _, xs, _) = _columns.records_to_columns(
        [(1, 2), (2, 2.5)], where="feeding partition 0")[0]
    assert ids.dtype == np.int64 and xs.dtype == np.float64 and xs.tolist() == [2.0, 2.5]
    layout: dict = {}
    _columns.records_to_columns([(i, i % 10) for i in range(1024)], "feeding partition 0",
                                layout=layout)
    with pytest.raises(EmberFeedError, match=r"^feeding partition 0: column 1: record 1024 is "
                                             r"str \('s'\), earlier records are int$"):
        _columns.records_to_columns([(i, "s") for i in range(1024, 1030)],
                                    "feeding partition 0", first=1024, layout=layout)
    layout = {}
    _columns.records_to_columns([(i, [1.0] * 4) for i in range(10)], "feeding partition 0",
                                layout=layout)
    with pytest.raises(EmberFeedError, match=r"record 10 has shape \(3,\), earlier records "
                                             r"have shape \(4,\)$"):
        _columns.records_to_columns([(i, [1.0] * 3) for i in range(10, 20)],
                                    "feeding partition 0", first=10, layout=layout)


def test_spark_ml_vectors_in_records_are_arrays():
    """Dense and sparse ML vectors in RDD records (df.rdd of a VectorAssembler
    output) stay arrays of their size; one of another size is named."""
    from pyspark.ml.linalg import Vectors

    from ember import _columns

    (name, _, width, x, _), _ = _columns.records_to_columns(
        [(Vectors.dense([1.0, 2.0, 0.0]), 1), (Vectors.sparse(3, [1], [5.0]), 0)],
        "feeding partition 0")[0]
    assert (name, width, x.tolist()) == ("0", 3, [[1.0, 2.0, 0.0], [0.0, 5.0, 0.0]])
    with pytest.raises(EmberFeedError, match=r"column 0: record 1 has shape \(4,\), earlier "
                                             r"records have shape \(3,\)"):
        _columns.records_to_columns([(Vectors.sparse(3, [0], [1.0]), 1),
                                     (Vectors.sparse(4, [0], [1.0]), 1)], "feeding partition 0")


def test_arrow_null_element_names_its_row_and_element():
    """A null inside an array<float> row is named by row (counted from the
    partition's start: ``first``) and element, not by its flat index."""
    import pyarrow as pa

    from ember import _columns

    rows = [[float(i)] * 4 for i in range(10)]
    rows[7][2] = None
    batch = pa.RecordBatch.from_arrays([pa.array(rows, pa.list_(pa.float32()))],
                                       names=["image"]).slice(4)  # offsets do not start at 0
    with pytest.raises(EmberFeedError, match=r"^feeding partition 2: column 'image': row 103, "
                                             r"element 2 is null; fill or drop nulls"):
        _columns.arrow_to_columns(batch, where="feeding partition 2", first=100)
    layout: dict = {}
    _columns.arrow_to_columns(pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0]])], ["v"]),
                              "feeding partition 0", layout=layout)
    with pytest.raises(EmberFeedError, match=r"column 'v': row 1 has 3 values, earlier rows "
                                             r"have 2"):
        _columns.arrow_to_columns(pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, 3.0]])],
                                                             ["v"]),
                                  "feeding partition 0", first=1, layout=layout)


def test_bad_record_fails_train_at_once_with_ember_feed_error(local_spark, tmp_path):
    """One str label among ints: train() raises EmberFeedError (not Spark's
    Py4JJavaError) with Ember's message first, within 2 s of the task failing."""
    import time

    sc = local_spark.sparkContext
    stamp = str(tmp_path / "stamp")
    records = [(i, "cat" if i == 117 else i % 10) for i in range(200)]
    data = sc.parallelize(records, 2).mapPartitionsWithIndex(nodefuns.stamp_at_end(stamp))
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        with pytest.raises(EmberFeedError) as err:
            cluster.train(data)
        caught = time.time()
    finally:
        cluster._stop_all()
    assert str(err.value).splitlines()[0] == (
        "feeding partition 1: column 1: record 17 is str ('cat'), earlier records are int")
    with open(stamp) as f:
        failed = float(f.read())
    assert caught - failed < 2.0, f"EmberFeedError came {caught - failed:.1f} s after the failure"


@pytest.mark.parametrize("bad", [range(1300, 1301), range(1024, 2048)],
                         ids=["one_record_of_a_batch", "a_whole_batch"])
def test_a_pickled_rdds_bad_record_is_named_as_unpickled(local_spark, tmp_path, bad):
    """An RDD fed from its pickled batches (no Python function of its own: its
    records are not unpickled, ember._grouping.frame_chunks) names a record
    whose array disagrees exactly as an unpickled one is named: by its index
    in the partition.  Its batches hold 1,024 records, two to a partition: a
    batch with one odd record is not of the form the C reader takes, and a
    batch of odd records disagrees with the partition's first chunk."""
    import numpy as np

    sc = local_spark.sparkContext
    records = [(i, np.full(3 if i - 2048 in bad else 4, i, np.float32)) for i in range(4096)]
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        with pytest.raises(EmberFeedError) as err:
            cluster.train(sc.parallelize(records, 2))
    finally:
        cluster._stop_all()
    assert str(err.value).splitlines()[0] == (
        f"feeding partition 1: column 1: record {bad[0]} has shape (3,), earlier records "
        "have shape (4,)")


def test_crashed_feeding_task_is_raised_at_once_with_its_cause_first(local_spark, tmp_path):
    """A feeding task whose Python worker dies (local mode: no retry, Spark
    aborts the job): train() raises EmberJobError within 2 s of the crash,
    its first line naming the task, the executor and Spark's reason, with
    Spark's exception chained behind it; the nodes are still there."""
    import time

    from ember.spark import EmberJobError

    sc = local_spark.sparkContext
    stamp = str(tmp_path / "stamp")
    data = sc.parallelize([(i, i % 10) for i in range(400)], 2) \
        .mapPartitionsWithIndex(nodefuns.crash_in_partition(stamp, 1, 50))
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60, heartbeat_timeout=10)
    try:
        with pytest.raises(EmberJobError) as err:
            cluster.train(data)
        caught = time.time()
    finally:
        cluster._stop_all()
    first = str(err.value).splitlines()[0]
    assert re.match(r"train call \d+: feeding task \d+ of stage [\d.]+ failed on executor driver "
                    r"\(host \S+\), 1 attempt\(s\): Python worker exited unexpectedly", first), first
    assert "Job aborted due to stage failure" in str(err.value.__cause__)
    with open(stamp) as f:
        crashed = float(f.read())
    assert caught - crashed < 2.0 + 1.0, f"train() raised {caught - crashed:.1f} s after the crash"


def test_inference_failures_are_raised_as_ember_errors_with_the_cause_first(local_spark,
                                                                            tmp_path):
    """inference() is lazy: what fails comes out of the action on its RDD (or
    on a narrow transformation of it).  A crashed task and a cancelled job
    raise EmberJobError, its first line the cause, Spark's exception chained;
    a node that raises mid-call raises its EmberNodeError with its traceback."""
    import threading
    import time

    from ember.spark import EmberJobError, EmberNodeError

    sc = local_spark.sparkContext
    stamp = str(tmp_path / "stamp")
    cluster = run(sc, nodefuns.double_it, {}, num_executors=2, input_mode=InputMode.SPARK,
                  reservation_timeout=60, heartbeat_timeout=10)
    try:
        crashing = sc.parallelize([(i, float(i)) for i in range(400)], 2) \
            .mapPartitionsWithIndex(nodefuns.crash_in_partition(stamp, 1, 50))
        with pytest.raises(EmberJobError) as err:
            cluster.inference(crashing).map(lambda r: r[1]).collect()
        caught = time.time()
        first = str(err.value).splitlines()[0]
        assert re.match(r"inference call \d+: task \d+ of stage [\d.]+ failed on executor "
                        r"driver \(host \S+\), 1 attempt\(s\): Python worker exited unexpectedly",
                        first), first
        assert "Job aborted due to stage failure" in str(err.value.__cause__)
        with open(stamp) as f:
            assert caught - float(f.read()) < 3.0

        slow = sc.parallelize([(i, float(i)) for i in range(40)], 2) \
            .mapPartitionsWithIndex(nodefuns.slow_partitions(30))
        cancelled = []

        def cancel() -> None:
            cancelled.append(time.monotonic())
            sc.cancelAllJobs()

        threading.Timer(2.0, cancel).start()
        with pytest.raises(EmberJobError) as err:
            cluster.inference(slow).saveAsTextFile(str(tmp_path / "never"))
        # timed from the cancel itself, against the 30 s the tasks take (a
        # timer fires late on a loaded machine: a fresh clone's run here once
        # raised 3.09 s after the timer was due)
        assert time.monotonic() - cancelled[0] < 5.0
        assert re.match(r"inference call \d+: job \d+ was cancelled", str(err.value)), err.value
        # the nodes still serve
        out = cluster.inference(sc.parallelize([(i, float(i)) for i in range(20)], 2)).collect()
        assert sorted(out) == [[i, 2.0 * i] for i in range(20)]
    finally:
        cluster.shutdown()

    cluster = run(sc, nodefuns.double_then_raise, {}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60, heartbeat_timeout=10)
    try:
        with pytest.raises(EmberNodeError) as node_err:
            cluster.inference(sc.parallelize([(i, float(i)) for i in range(4000)], 4)).count()
        assert "RuntimeError: the model blew up after its first batch" in str(node_err.value)
        assert str(node_err.value).startswith("ember node ")
    finally:
        cluster._stop_all()


def test_shutdown_after_a_100_mib_record_takes_its_usual_time(local_spark, tmp_path):
    """One record of 100 MiB among small ones: it is fed whole, and
    shutdown() then takes its usual fraction of a second (issue 36 saw 5.1 s
    once; 0.2-0.3 s here), not seconds."""
    import time

    sc = local_spark.sparkContext
    big = 100 << 20
    rdd = sc.parallelize(range(4), 2).map(lambda i: (i, b"x" * big if i == 0 else b"y"))
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        assert cluster.train(rdd) == 4
    finally:
        started = time.monotonic()
        cluster.shutdown()
    took = time.monotonic() - started
    assert took < 2.0, f"shutdown() took {took:.1f} s"
    ids = sorted(i for n in read_json_files(str(tmp_path)) for i in n["ids"])
    assert ids == [0, 1, 2, 3]


def test_dataframe_null_element_names_row_of_the_partition(local_spark, tmp_path):
    """A null element of an array<float> column in the third Arrow batch of a
    partition: named by its row in the partition and its element."""
    spark = local_spark
    rows = [(i, [1.0, 2.0, None if i == 9 else 3.0]) for i in range(12)]
    df = spark.createDataFrame(rows, "id long, image array<float>").coalesce(1)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "4")
    cluster = run(spark.sparkContext, nodefuns.count_records, {"out": str(tmp_path)},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        with pytest.raises(EmberFeedError) as err:
            cluster.train(df)
    finally:
        cluster._stop_all()
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert str(err.value).startswith(
        "feeding partition 0: column 'image': row 9, element 2 is null"), str(err.value)


def test_null_array_upstream_is_named_without_a_spurious_arrow_error(local_spark, tmp_path):
    """ember.tensors.pack meets a null array upstream of the feed: train()
    raises its EmberFeedError, and the node hears nothing of the feeding
    task's broken Arrow stream (it used to log an ArrowInvalid)."""
    from ember import tensors

    spark = local_spark
    rows = [(i, None if i == 5 else [1.0, 2.0]) for i in range(10)]
    df = tensors.pack(spark.createDataFrame(rows, "id long, v array<float>").coalesce(1),
                      {"v": (2,)})
    cluster = run(spark.sparkContext, nodefuns.count_records, {"out": str(tmp_path)},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        with pytest.raises(EmberFeedError) as err:
            cluster.train(df)
        assert str(err.value).startswith(
            "ember.tensors.pack: partition 0: column 'v' has a null array at row 5"), str(err.value)
    finally:
        cluster.shutdown(timeout=60)
    errors = [e for info in read_json_files(str(tmp_path)) for e in info["errors"]]
    assert not any("Arrow" in e for e in errors), errors


def _many_train_calls(sc, out, calls, first_call=0):
    """``calls`` train() calls of one record per node on one cluster, whose feed
    call ids start after ``first_call``; checks every node read every call's
    record, and saw each call end (a batch never spans two calls)."""
    rdd = sc.parallelize([1, 2], 2).cache()
    rdd.count()
    cluster = run(sc, nodefuns.count_calls, {"out": str(out), "expect": calls},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    cluster._feed_seq = first_call  # the id of the cluster's last feed call
    start = time.monotonic()
    try:
        fed = [cluster.train(rdd, num_epochs=1, feed_timeout=60) for _ in range(calls)]
    finally:
        cluster.shutdown(timeout=120)
        rdd.unpersist()
    took = time.monotonic() - start
    print(f"{calls} train() calls in {took:.0f} s ({took / calls * 1000:.1f} ms per call)")
    assert fed == [2] * calls
    infos = sorted(read_json_files(str(out)), key=lambda i: i["index"])
    assert [(i["total"], i["value_sum"], i["batches"], i["ends"]) for i in infos] == \
        [(calls, calls * 1, calls, calls), (calls, calls * 2, calls, calls)]


def test_train_calls_past_32_bit_call_ids(local_spark, tmp_path):
    """Feed call ids are 64-bit end to end: 60 train() calls whose ids cross
    2^32 half way (the call number used to share the partition's 32 bits and
    stopped the feed at call 4,096).  The 10,000-call run is the next test."""
    _many_train_calls(local_spark.sparkContext, tmp_path, 60, (1 << 32) - 30)


@pytest.mark.skipif(os.environ.get("EMBER_LONG_TESTS") != "1",
                    reason="10,000 Spark jobs take about 40 min on 2 cores (each train() is a "
                           "Spark job of ~0.25 s): run with EMBER_LONG_TESTS=1 (make test-long)")
def test_ten_thousand_train_calls_on_one_cluster(local_spark, tmp_path):
    """A long-lived cluster takes any number of train() calls (it stopped
    accepting feeds at call 4,096)."""
    _many_train_calls(local_spark.sparkContext, tmp_path, 10000)


def test_keras_fits_on_the_feed_as_a_native_dataset(local_spark, tmp_path):
    """ember.tf.feed_dataset on Spark: each node's Keras fit reads its share
    of a DataFrame's epochs through the TensorFlow op, every row once."""
    n = 4096
    x, y = nodefuns.synthetic_points(n)
    df = local_spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(n)],
                                     "x array<float>, y long").repartition(4)
    cluster = run(local_spark.sparkContext, nodefuns.keras_fit_on_feed_dataset,
                  {"out": str(tmp_path), "n": n}, num_executors=2, input_mode=InputMode.SPARK,
                  reservation_timeout=60)
    try:
        assert cluster.train(df, num_epochs=4) == 4 * n
    finally:
        cluster.shutdown(timeout=120)
    nodes = read_json_files(str(tmp_path))
    assert sum(node["rows"] for node in nodes) == 4 * n
    for node in nodes:
        assert node["accuracy"] > 0.8, node  # chance: 0.5
        assert "already read by ember.tf.feed_dataset" in node["refused"]
