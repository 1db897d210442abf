"""ember.ml on a local Spark: a Fashion-MNIST Pipeline (fit on 2 nodes, 10,000
test rows, accuracy with Spark's evaluator, save/load with identical
predictions), CrossValidator over a 2-point grid, SavedModels with and
without signatures, output column types, bad input named on the driver, and
a Structured Streaming query through EmberModel.transform; the direct path's
input kinds, worker reuse and recovery, and its errors named by column and row."""

from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np
import pytest

# (not importorskip: Python workers import this module for its mapInArrow
# functions, and should not pay for importing TensorFlow)
if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed", allow_module_level=True)

from ember import _spark_compat  # noqa: E402
from ember.ml import EmberEstimator, EmberModel, ModelInputError, TFEstimator, TFModel  # noqa: E402
from ml_fashion import (CAST_SQL, SCALE_SQL, check_fitted_pipeline, fashion_frame,  # noqa: E402
                        fashion_pipeline)

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

#: ArrowPath 'udf' as a test parameter: Spark 4.1 brought the Arrow UDF it runs
UDF = pytest.param("udf", marks=pytest.mark.skipif(
    not _spark_compat.has(_spark_compat.ARROW_UDF),
    reason="ArrowPath 'udf' needs Spark 4.1 (pyspark.sql.functions.arrow_udf)"))


def _train_args(tmp_path, **extra):
    return argparse.Namespace(learning_rate=1e-3, intra_op_threads=1, inter_op_threads=1,
                              **extra)


# --------------------------------------------------------------------------- pipeline

def test_fashion_mnist_pipeline_fit_transform_save_load(local_spark, tmp_path):
    from examples.fashion_mnist import model as fm

    spark = local_spark
    train = fashion_frame(spark, "train", parts=4).cache()
    test = fashion_frame(spark, "test", parts=2).cache()
    assert train.count() == 60000 and test.count() == 10000
    est = TFEstimator(fm.train_spark, _train_args(tmp_path, train_records=60000))
    pipeline = fashion_pipeline(est, 4, str(tmp_path))
    fitted = pipeline.fit(train)
    model = fitted.stages[1]
    assert isinstance(model, EmberModel) and model.getInputMapping() == {"image": "image"}

    _, loaded_est = check_fitted_pipeline(fitted, pipeline, test, str(tmp_path), "TensorFlow")
    assert isinstance(loaded_est, EmberEstimator)
    assert loaded_est.train_fn is fm.train_spark
    assert loaded_est.tf_args.train_records == 60000
    assert loaded_est.getClusterSize() == 2 and loaded_est.getEpochs() == 4
    assert loaded_est.getInputMapping() == {"image": "image", "label": "label"}
    train.unpersist()
    test.unpersist()


def test_cross_validator_two_point_grid(local_spark, tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import SQLTransformer
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from examples.fashion_mnist import model as fm

    spark = local_spark
    df = SQLTransformer(statement=SCALE_SQL).transform(
        fashion_frame(spark, "train", limit=1200, parts=2)).cache()
    est = (EmberEstimator(fm.train_spark, {"learning_rate": 1e-3, "intra_op_threads": 1,
                                           "train_records": 600})
           .setInputMapping({"image": "image", "label": "label"})
           .setOutputMapping({"classes": "class"})
           .setClusterSize(1).setBatchSize(32).setReservationTimeout(120)
           .setModelDir(str(tmp_path / "model")).setExportDir(str(tmp_path / "export")))
    # a dict tf_args reaches train_fn as a dict: fm.train_spark reads attributes,
    # so give it a Namespace the way TFoS users do
    est.tf_args = argparse.Namespace(**est.tf_args)
    grid = ParamGridBuilder().addGrid(est.epochs, [1, 3]).build()
    evaluator = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction",
                                                  metricName="accuracy")
    cv = CrossValidator(estimator=Pipeline(stages=[est, SQLTransformer(statement=CAST_SQL)]),
                        estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=7)
    cvm = cv.fit(df)
    assert len(cvm.avgMetrics) == 2
    print(f"CrossValidator accuracy by epochs [1, 3]: {cvm.avgMetrics}")
    assert all(0.3 < m <= 1.0 for m in cvm.avgMetrics)
    best = cvm.bestModel.stages[0]
    assert isinstance(best, EmberModel)
    assert best.tf_args.epochs == [1, 3][int(np.argmax(cvm.avgMetrics))]
    df.unpersist()


# --------------------------------------------------------------------------- small models

W = np.arange(8, dtype=np.float32).reshape(4, 2) / 10.0


def _expected(x, n):
    y = x @ W
    return y, (x.sum(axis=1) * 2.0).astype(np.float64), n * 3


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """A TF2 SavedModel with a signature (x float32 [None, 4], n int64 [None] ->
    y float32 [None, 2], s float64 [None], k int64 [None]) and a TF1 graph
    SavedModel (placeholder x -> tensor y, no signature used)."""
    import tensorflow as tf

    root = tmp_path_factory.mktemp("models")
    sig_dir, graph_dir = str(root / "sig"), str(root / "graph")

    class Small(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(W)

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x"),
                                      tf.TensorSpec([None], tf.int64, name="n")])
        def serve(self, x, n):
            return {"y": tf.matmul(x, self.w),
                    "s": tf.cast(tf.reduce_sum(x, axis=1), tf.float64) * 2.0,
                    "k": n * 3}

    m = Small()
    tf.saved_model.save(m, sig_dir, signatures={"predict": m.serve})

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(W))
        tf.identity(tf.matmul(x, w), name="y")
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            b = tf.compat.v1.saved_model.Builder(graph_dir)
            b.add_meta_graph_and_variables(sess, ["serve"])
            b.save()
            # the same graph as a TF1 checkpoint (+ .meta) in a model dir
            tf.compat.v1.train.Saver().save(sess, str(root / "ckpt" / "model"), global_step=3)
    return {"sig": sig_dir, "graph": graph_dir, "ckpt": str(root / "ckpt")}


def _small_frame(spark, n=500, parts=3):
    rng = np.random.default_rng(3)
    x = rng.random((n, 4), dtype=np.float32)
    rows = [(i, x[i].tolist(), i) for i in range(n)]
    return spark.createDataFrame(rows, "id long, feats array<float>, cnt long").repartition(parts), x


def _sig_model(path):
    return (EmberModel().setExportDir(path).setSignatureDefKey("predict")
            .setInputMapping({"feats": "x", "cnt": "n"})
            .setOutputMapping({"y": "y", "s": "s", "k": "k"}).setBatchSize(64))


@pytest.mark.parametrize("path", [None, UDF, "mapInArrow"])
def test_signature_model_types_and_values(local_spark, small_models, path):
    df, x = _small_frame(local_spark)
    out = _sig_model(small_models["sig"]).setArrowPath(path).transform(df)
    plan = out._jdf.queryExecution().executedPlan().toString()
    if path is None:  # the default: the direct path, the rows of an RDD built by Ember's jar
        assert "ExistingRDD" in plan and "Python" not in plan and "Arrow" not in plan, plan
    elif path == "udf":  # one Python evaluation for the three output columns
        assert plan.count("ArrowEvalPython") == 1, plan
    else:
        assert "MapInArrow" in plan, plan
    types = {f.name: f.dataType.simpleString() for f in out.schema.fields}
    assert types == {"id": "bigint", "feats": "array<float>", "cnt": "bigint",
                     "y": "array<float>", "s": "double", "k": "bigint"}
    rows = sorted(out.collect(), key=lambda r: r["id"])
    ids = np.array([r["id"] for r in rows])
    y, s, k = _expected(x[ids], ids)
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), y, rtol=1e-6)
    np.testing.assert_allclose(np.array([r["s"] for r in rows]), s, rtol=1e-6)
    assert [r["k"] for r in rows] == k.tolist()


def test_vector_column_tensor_names_and_checkpoint(local_spark, small_models):
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    df, x = _small_frame(local_spark, n=200, parts=2)
    flat = df.select("id", *[F.col("feats")[i].alias(f"f{i}") for i in range(4)])
    vec = VectorAssembler(inputCols=[f"f{i}" for i in range(4)], outputCol="features").transform(flat)
    # a TF1 graph, mappings by tensor name (no signature)
    m = (EmberModel().setExportDir(small_models["graph"]).setSignatureDefKey(None)
         .setInputMapping({"features": "x"}).setOutputMapping({"y:0": "y"}))
    rows = sorted(m.transform(vec).select("id", "y").collect(), key=lambda r: r["id"])
    ids = np.array([r["id"] for r in rows])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    # the same graph as a TF1 checkpoint in ModelDir (no ExportDir)
    c = (EmberModel().setModelDir(small_models["ckpt"]).setInputMapping({"features": "x"})
         .setOutputMapping({"y": "y"}))
    rows = sorted(c.transform(vec).select("id", "y").collect(), key=lambda r: r["id"])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    with pytest.raises(ModelInputError, match="holds no checkpoint"):
        c.setModelDir(small_models["graph"]).transform(vec)
    bad = m.setOutputMapping({"nope": "y"})
    with pytest.raises(ModelInputError, match="tensor 'nope' is not in the graph"):
        bad.transform(vec)


@pytest.mark.parametrize("case, message", [
    ("missing", r"InputMapping column\(s\) \['feats'\] not in the DataFrame"),
    ("string", r"column 'feats' has type array<string>; model input 'x' \(float32 \[None, 4\]\) needs numbers"),
    ("float_for_int", r"column 'cnt' has type double; model input 'n' \(int64 \[None\]\) takes integers"),
    ("scalar_for_array", r"column 'feats' holds one number per row \(float\); model input 'x'"),
    ("array_for_scalar", r"column 'cnt' holds arrays \(array<bigint>\); model input 'n'"),
    ("length", r"column 'feats' has arrays of 3 values; model input 'x' \(float32 \[None, 4\]\) takes 4 per row"),
    ("signature", r"SignatureDefKey 'nope' is not in .* \(signatures: \['predict'\]\)"),
    ("output", r"signature 'predict' has no output 'z' \(outputs: \['k', 's', 'y'\]\)"),
])
def test_bad_input_is_named_before_any_task(local_spark, small_models, case, message):
    spark = local_spark
    m = _sig_model(small_models["sig"])
    frames = {
        "missing": "SELECT 1L AS id, 2L AS cnt",
        "string": "SELECT array('a','b','c','d') AS feats, 1L AS cnt",
        "float_for_int": "SELECT array(1.0F, 2.0F, 3.0F, 4.0F) AS feats, 1.5D AS cnt",
        "scalar_for_array": "SELECT 1.0F AS feats, 1L AS cnt",
        "array_for_scalar": "SELECT array(1.0F, 2.0F, 3.0F, 4.0F) AS feats, array(1L) AS cnt",
        "length": "SELECT array(1.0F, 2.0F, 3.0F) AS feats, 1L AS cnt",
    }
    df = spark.sql(frames.get(case, "SELECT array(1.0F, 2.0F, 3.0F, 4.0F) AS feats, 1L AS cnt"))
    if case == "signature":
        m.setSignatureDefKey("nope")
    if case == "output":
        m.setOutputMapping({"z": "z"})
    tracker = spark.sparkContext.statusTracker()
    before = tracker.getJobIdsForGroup(None)
    with pytest.raises(ModelInputError, match=message):
        m.transform(df)
    # only the length check may run a (one-row) job; no inference task ran
    if case != "length":
        assert tracker.getJobIdsForGroup(None) == before


def test_estimator_persistence_and_args(local_spark, tmp_path):  # save and load need a session
    from examples.fashion_mnist import model as fm

    est = (EmberEstimator(fm.train_spark, {"lr": 0.5}).setInputMapping({"a": "x"})
           .setClusterSize(3).setSteps(7).setMaxRestarts(2))
    assert (est.getBatchSize(), est.getNumPS(), est.getReaders(), est.getTensorboard(),
            est.getEpochs(), est.getProtocol(), est.getInputMode()) == (100, 0, 1, False, 1, "grpc", 1)
    merged = est._merged_args(est.tf_args)
    assert merged["lr"] == 0.5 and merged["steps"] == 7 and merged["cluster_size"] == 3
    assert merged["input_mapping"] == {"a": "x"} and merged["max_restarts"] == 2
    est.save(str(tmp_path / "est"))
    back = EmberEstimator.load(str(tmp_path / "est"))
    assert back.train_fn is fm.train_spark and back.tf_args == {"lr": 0.5}
    assert back.getClusterSize() == 3 and back.getSteps() == 7 and back.uid == est.uid
    with pytest.raises(ValueError, match="only a function importable by module and name"):
        EmberEstimator(lambda args, ctx: None, {}).save(str(tmp_path / "lambda"))
    with pytest.raises(ValueError, match="JSON-serializable"):
        EmberEstimator(fm.train_spark, {"bad": object()}).save(str(tmp_path / "obj"))


def test_streaming_file_source_to_file_sink(local_spark, small_models, tmp_path):
    spark = local_spark
    df, x = _small_frame(spark, n=300, parts=3)
    src, sink, ckpt = (str(tmp_path / d) for d in ("in", "out", "ckpt"))
    df.write.parquet(src)
    stream = spark.readStream.schema(df.schema).option("maxFilesPerTrigger", 1).parquet(src)
    assert stream.isStreaming
    out = _sig_model(small_models["sig"]).transform(stream)
    query = (out.writeStream.format("parquet").option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start(sink))
    query.awaitTermination(180)
    assert query.exception() is None
    rows = sorted(spark.read.parquet(sink).collect(), key=lambda r: r["id"])
    assert len(rows) == 300
    ids = np.array([r["id"] for r in rows])
    y, s, k = _expected(x[ids], ids)
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), y, rtol=1e-6)
    assert [r["k"] for r in rows] == k.tolist()
    assert TFModel is EmberModel


# --------------------------------------------------------------------------- direct path

def _direct_workers(spark):
    """pids of the direct-path inference workers of ``spark``'s JVM (local
    mode: the executor's), whatever model each started for."""
    jvm = str(spark.sparkContext._jvm.ProcessHandle.current().pid())
    pids = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if b"ember._direct_launcher" in argv and ppid == jvm:
            pids.add(int(d))
    return pids


def _direct_path_check(spark, small_models):
    """(transform-and-check, packed frame) of the direct-path tests: 400 rows
    of a tensor column (ember.tensors) and a bigint column in 2 partitions,
    2 workers a round (each loads TensorFlow and the model)."""
    from ember import tensors

    df, x = _small_frame(spark, n=400, parts=2)
    packed = tensors.pack(df, {"feats": (4,)})
    m = _sig_model(small_models["sig"]).setArrowPath("direct")

    def check(frame):
        rows = sorted(m.transform(frame).collect(), key=lambda r: r["id"])
        assert len(rows) == 400
        ids = np.array([r["id"] for r in rows])
        y, s, k = _expected(x[ids], ids)
        np.testing.assert_allclose(np.array([r["y"] for r in rows]), y, rtol=1e-6)
        np.testing.assert_allclose(np.array([r["s"] for r in rows]), s, rtol=1e-6)
        assert [r["k"] for r in rows] == k.tolist()
    return check, packed, m


def test_direct_path_tensor_column(local_spark, small_models):
    """A tensor column and a bigint column through the direct path (the
    Spark jar's side of it: the compatibility subset runs this one)."""
    check, packed, m = _direct_path_check(local_spark, small_models)
    check(packed)
    assert m.transform(packed).schema["feats"].dataType.simpleString() == "binary"


def test_direct_path_worker_reuse(local_spark, small_models):
    """The model's workers serve the next transform (no new process), another
    model's transform too (the workers load it), and workers killed while
    idle are replaced, never handed a task."""
    import signal

    check, packed, m = _direct_path_check(local_spark, small_models)
    check(packed)
    first = _direct_workers(local_spark)
    assert first
    # each launcher had its worker forked, TensorFlow already imported
    from conftest import forked_direct_worker, wait_gone  # here: Python workers import this module

    forked = {pid: forked_direct_worker(pid) for pid in first}
    assert None not in forked.values(), forked
    # no new process from here on (a worker an earlier test left idle may
    # reach its idle time, EMBER_DIRECT_IDLE_SECONDS, and go meanwhile)
    check(packed)
    assert first >= _direct_workers(local_spark)  # the model stayed loaded
    # a TF1 graph: other inputs, outputs and batch size, on the same workers
    df, x = _small_frame(local_spark, n=400, parts=2)
    graph = (EmberModel().setExportDir(small_models["graph"]).setSignatureDefKey(None)
             .setInputMapping({"feats": "x"}).setOutputMapping({"y:0": "y"})
             .setBatchSize(50).setArrowPath("direct"))
    rows = sorted(graph.transform(df).select("id", "y").collect(), key=lambda r: r["id"])
    ids = np.array([r["id"] for r in rows])
    assert len(ids) == 400
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    assert first >= _direct_workers(local_spark)
    check(packed)  # and back to the first model
    assert first >= _direct_workers(local_spark) != set()
    gone = set()
    for _ in range(3):  # the next task starts at once, before the JVM may have reaped them
        alive = _direct_workers(local_spark) - gone
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        gone |= alive
        check(packed)
        assert _direct_workers(local_spark) - gone
    # a launcher killed (SIGKILL: it cannot pass it on) leaves no worker
    # behind: the JVM closes its pipes, and the worker ends with its input
    assert wait_gone(list(forked.values()), 30) == []


@pytest.mark.parametrize("path", [UDF, "mapInArrow"])
def test_tensor_column_on_the_arrow_paths(local_spark, small_models, path):
    from ember import tensors

    df, x = _small_frame(local_spark, n=200, parts=2)
    out = _sig_model(small_models["sig"]).setArrowPath(path).transform(
        tensors.pack(df, {"feats": (2, 2)}))  # the model's rows are [4]: reshaped
    rows = sorted(out.collect(), key=lambda r: r["id"])
    ids = np.array([r["id"] for r in rows])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-6)
    short = tensors.pack(local_spark.sql("SELECT array(1.0F, 2.0F, 3.0F) AS feats, 1L AS cnt"),
                         {"feats": (3,)})
    with pytest.raises(ModelInputError, match=r"tensor column 'feats' holds float32\[3\] per "
                                              r"row; model input 'x' \(float32 \[None, 4\]\) "
                                              r"takes 4 values per row"):
        _sig_model(small_models["sig"]).setArrowPath(path).transform(short)


@pytest.mark.parametrize("case, message", [
    ("short", r"column 'feats' row 7 of partition 0 has 3 values; the model takes 4"),
    ("null_value", r"column 'feats' row 5 of partition 0 holds a null value"),
    ("null_row", r"column 'feats' is null at row 2 of partition 0"),
])
def test_direct_path_bad_rows_are_named(local_spark, small_models, case, message):
    """Rows the driver's one-row check cannot see: the task fails naming the
    column and row, and the model's next transform runs on fresh workers."""
    good = [1.0, 2.0, 3.0, 4.0]
    bad = {"short": (7, [1.0, 2.0, 3.0]), "null_value": (5, [1.0, None, 3.0, 4.0]),
           "null_row": (2, None)}[case]
    rows = [(i, bad[1] if i == bad[0] else good, i) for i in range(10)]
    df = local_spark.createDataFrame(rows, "id long, feats array<float>, cnt long").coalesce(1)
    m = _sig_model(small_models["sig"]).setArrowPath("direct")
    with pytest.raises(Exception, match=message):
        m.transform(df).collect()
    fine = local_spark.createDataFrame([(i, good, i) for i in range(10)],
                                       "id long, feats array<float>, cnt long")
    assert sorted(r["k"] for r in m.transform(fine).collect()) == [3 * i for i in range(10)]


def test_direct_path_model_error_limit_and_fallback(local_spark, tmp_path):
    """A model that fails on some rows fails the task with the model's own
    message; a transform cut short by limit() ends its task cleanly; a streaming
    DataFrame takes the Arrow UDF path, and asking for 'direct' there says why."""
    import tensorflow as tf

    class Checked(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="n")])
        def serve(self, n):
            with tf.control_dependencies([tf.debugging.assert_non_negative(
                    n, message="ember test: n must be >= 0")]):
                return {"k": n * 3}

    export = str(tmp_path / "checked")
    m = Checked()
    tf.saved_model.save(m, export, signatures={"serving_default": m.serve})
    model = EmberModel().setExportDir(export).setInputMapping({"n": "n"}) \
        .setOutputMapping({"k": "k"}).setBatchSize(16)
    df = local_spark.range(0, 1000, numPartitions=2).withColumnRenamed("id", "n")
    assert sorted(r["k"] for r in model.transform(df).collect()) == [3 * i for i in range(1000)]
    assert len(model.transform(df).limit(5).collect()) == 5
    neg = local_spark.range(-3, 100, numPartitions=1).withColumnRenamed("id", "n")
    with pytest.raises(Exception, match="ember test: n must be >= 0"):
        model.transform(neg).collect()
    assert model.transform(df).count() == 1000
    stream = local_spark.readStream.format("rate").load().selectExpr("value AS n")
    assert model.transform(stream).isStreaming  # (the direct path's output would not be)
    with pytest.raises(ValueError, match="ArrowPath 'direct' cannot run this DataFrame: "
                                         "a streaming DataFrame"):
        model.setArrowPath("direct").transform(stream)
