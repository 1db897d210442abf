"""TensorFlowOnSpark programs on Ember (ember.compat.tfos), on local Spark.

The programs under tfos_programs/ import only from ember.compat.tfos (plus
TensorFlow, numpy, pyspark), as TFoS 2.2.x programs after changing their
imports.  Fashion-MNIST subsets keep each TensorFlow test well under a minute
or two on a 2-core machine; record counts are always checked, accuracy where
a model is trained.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import time

import numpy as np
import pytest

import simcluster
from conftest import read_json_files
from ember.compat.tfos import TFCluster, TFNode, dfutil
from ember.compat.tfos._node import TFNodeContext, cluster_spec_of, tf_config_of
from tfos_programs import feed_programs as fp

TRAIN, TEST = 4096, 1000


def _json(out):
    return {i["executor_id"]: i for i in read_json_files(str(out))}


# --------------------------------------------------------------------------- no TF

def test_hdfs_path_matches_tensorflowonspark():
    ctx = TFNodeContext(0, "worker", 0, {}, "file://", "/home/me/job")
    assert TFNode.hdfs_path(ctx, "model") == "file:///home/me/job/model"
    assert TFNode.hdfs_path(ctx, "/abs/model") == "file:///abs/model"
    assert TFNode.hdfs_path(ctx, "s3a://bucket/x") == "s3a://bucket/x"
    assert ctx.absolute_path("m") == "file:///home/me/job/m"
    h = TFNodeContext(0, "worker", 0, {}, "hdfs://nn:8020", "/ignored")
    import getpass
    assert h.absolute_path("data") == f"hdfs://nn:8020/user/{getpass.getuser()}/data"
    assert h.absolute_path("/data") == "hdfs://nn:8020/data"


def test_cluster_spec_and_tf_config_follow_tensorflowonspark():
    nodes = [dict(index=i, role=r, task_index=t, host="h", ports=[1000 + i])
             for i, (r, t) in enumerate([("ps", 0), ("chief", 0), ("evaluator", 0),
                                         ("worker", 0), ("worker", 1)])]
    spec = cluster_spec_of(nodes, "master")
    assert list(spec) == ["ps", "master", "evaluator", "worker"]
    assert spec["worker"] == ["h:1003", "h:1004"]
    cfg = json.loads(tf_config_of(spec, "worker", 1))
    assert cfg == {"cluster": spec, "task": {"type": "worker", "index": 1},
                   "environment": "cloud"}
    assert tf_config_of({"worker": ["h:1"]}, "worker", 0) is None


def test_run_validates_arguments_like_tensorflowonspark(local_spark):
    sc = local_spark.sparkContext
    with pytest.raises(Exception, match="only supported in InputMode.TENSORFLOW"):
        TFCluster.run(sc, fp.roles, {}, 3, 1, input_mode=TFCluster.InputMode.SPARK,
                      driver_ps_nodes=True)
    with pytest.raises(Exception, match="evaluator nodes is only supported"):
        TFCluster.run(sc, fp.roles, {}, 3, 0, input_mode=TFCluster.InputMode.SPARK,
                      eval_node=True)
    with pytest.raises(AssertionError, match="requires 3 nodes"):
        TFCluster.run(sc, fp.roles, {}, 2, 1, master_node="chief", eval_node=True)


def test_roles_order_and_tf_config_only_with_a_master(local_spark, tmp_path):
    sc = local_spark.sparkContext
    out = tmp_path / "a"
    out.mkdir()
    cluster = TFCluster.run(sc, fp.roles, {"out": str(out)}, 4, 1, master_node="master",
                            eval_node=True, reservation_timeout=60)
    cluster.shutdown(timeout=60)
    infos = _json(out)
    roles = {i: (infos[i]["job_name"], infos[i]["task_index"]) for i in infos}
    assert roles == {0: ("ps", 0), 1: ("master", 0), 2: ("evaluator", 0), 3: ("worker", 0)}
    for info in infos.values():
        assert list(info["cluster_spec"]) == ["ps", "master", "evaluator", "worker"]
        assert info["num_workers"] == 2
        cfg = json.loads(info["tf_config"])
        assert cfg["task"] == {"type": info["job_name"], "index": info["task_index"]}
        assert info["defaultFS"] == "file://" and info["working_dir"] == os.getcwd()
    assert [n["job_name"] for n in cluster.cluster_info] == ["ps", "master", "evaluator", "worker"]

    out = tmp_path / "b"
    out.mkdir()
    cluster = TFCluster.run(sc, fp.roles, {"out": str(out)}, 2, 0, reservation_timeout=60)
    cluster.shutdown(timeout=60)
    infos = _json(out)
    assert {(i["job_name"], i["task_index"]) for i in infos.values()} == {("worker", 0),
                                                                         ("worker", 1)}
    assert all(i["tf_config"] is None for i in infos.values())  # no master: no TF_CONFIG


def test_reservation_error_names_missing_nodes_and_cause(local_spark):
    sc = local_spark.sparkContext  # local[4]: 4 slots for 6 barrier tasks
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        TFCluster.run(sc, fp.roles, {}, 6, 0, reservation_timeout=20)
    assert time.monotonic() - start < 60
    assert "only 4 task slot(s) for 6 nodes" in str(err.value)


def test_train_num_epochs_zero_is_ten_passes_uneven_partitions(local_spark, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ember")
    sc = local_spark.sparkContext
    # uneven partitions (one empty); TFoS's keras example reads with train_mode=False
    rdd = sc.parallelize([(i, i) for i in range(300)], 3).mapPartitionsWithIndex(
        lambda p, it: it if p != 1 else iter(()))
    cluster = TFCluster.run(sc, fp.count_feed, {"out": str(tmp_path), "train_mode": False},
                            2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=60)
    fed = cluster.train(rdd)
    cluster.shutdown(timeout=60)
    assert fed == 10 * rdd.count()
    assert any(r.name == "ember.compat.tfos" and r.levelno == logging.INFO
               and "num_epochs=0): feeding the data 10 times" in r.getMessage()
               for r in caplog.records)
    got = collections.Counter(i for info in _json(tmp_path).values() for i in info["ids"])
    assert got == collections.Counter({r[0]: 10 for r in rdd.collect()})


def test_node_dying_while_a_call_starts_is_named_at_once(local_spark):
    """The chief reads its feed only after 60 s, so the call's feeding tasks
    wait on it, while the worker raises: the worker's error, traceback
    included, comes within seconds (it once came after the chief's 60 s and
    then the feed timeout, connecting to a dead node)."""
    from ember.spark import EmberNodeError

    sc = local_spark.sparkContext
    cluster = TFCluster.run(sc, fp.worker_dies_while_chief_sleeps,
                            {"chief_sleep": 60, "worker_sleep": 2}, 2, 0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=60)
    start = time.monotonic()
    try:
        with pytest.raises(EmberNodeError) as err:
            cluster.train(sc.parallelize(range(100), 2), num_epochs=1, feed_timeout=120)
        took = time.monotonic() - start
    finally:
        cluster.server._stop_all(wait=False)
    assert err.value.node == 1 and "worker:0" in str(err.value), str(err.value)
    assert "worker gave up before reading its feed" in str(err.value)
    assert took < 10, f"the error took {took:.1f} s"


def test_eval_feed_alongside_training(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = TFCluster.run(sc, fp.train_and_eval_feeds, {"out": str(tmp_path)}, 2, 0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            queues=["input", "eval", "output", "error"], reservation_timeout=60)
    cluster.train(sc.parallelize(range(0, 400), 4), num_epochs=1)
    cluster.train(sc.parallelize(range(1000, 1100), 2), num_epochs=1, qname="eval")
    cluster.shutdown(timeout=60)
    infos = _json(tmp_path).values()
    assert sorted(i for info in infos for i in info["train"]) == list(range(400))
    assert sorted(i for info in infos for i in info["eval"]) == list(range(1000, 1100))
    with pytest.raises(AssertionError, match="Unknown queue"):
        cluster.train(sc.parallelize(range(3)), 1, qname="nope")


def test_inference_results_and_input_mapping(local_spark):
    sc = local_spark.sparkContext
    cluster = TFCluster.run(sc, fp.square, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK,
                            reservation_timeout=60)
    try:
        out = cluster.inference(sc.parallelize([(i,) for i in range(500)], 4)).collect()
    finally:
        cluster.shutdown(timeout=60)
    assert [tuple(r) for r in out] == [(i, i * i) for i in range(500)]
    cluster = TFCluster.run(sc, fp.mapped, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK,
                            reservation_timeout=60)
    try:
        out = cluster.inference(sc.parallelize([(i, 2 * i) for i in range(123)], 3)).collect()
    finally:
        cluster.shutdown(timeout=60)
    assert out == [3 * i for i in range(123)]


def test_streaming_reads_across_micro_batches(local_spark, tmp_path):
    from pyspark.streaming import StreamingContext

    sc = local_spark.sparkContext
    ssc = StreamingContext(sc, 1)
    batches = [sc.parallelize([(i,) for i in range(k * 50, k * 50 + 50)], 2) for k in range(4)]
    stream = ssc.queueStream(batches, oneAtATime=True)
    cluster = TFCluster.run(sc, fp.streaming_count, {"out": str(tmp_path), "stop_after": 60},
                            1, 0, input_mode=TFCluster.InputMode.SPARK, reservation_timeout=60)
    cluster.train(stream, feed_timeout=60)
    ssc.start()
    cluster.shutdown(ssc, timeout=120)
    ssc.stop(stopSparkContext=False)
    ids = _json(tmp_path)[0]["ids"]
    # 60 records span the first two micro-batches (50 each): next_batch waited for the
    # second one instead of ending at the end of the first
    assert len(ids) == 60 and len(set(ids)) == 60
    assert all(i < 100 for i in ids) and min(ids) < 50 <= max(ids)


def test_streaming_dataframe_reads_across_micro_batches(local_spark, tmp_path):
    """TFCluster.train on a streaming DataFrame (Structured Streaming, Ember's
    addition): the TFoS program reads it as it read a DStream."""
    import streamfuns

    spark = local_spark
    streamfuns.write_id_files(str(tmp_path / "src"), 4, 50)
    stream = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1) \
        .json(str(tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(spark.sparkContext, fp.streaming_count,
                            {"out": str(out), "stop_after": 60}, 1, 0,
                            input_mode=TFCluster.InputMode.SPARK, reservation_timeout=60)
    assert cluster.train(stream, feed_timeout=60) is None
    cluster.shutdown(timeout=120)
    assert not cluster.stream_query.isActive
    ids = _json(out)[0]["ids"]
    assert len(ids) == 60 and len(set(ids)) == 60
    assert all(i < 100 for i in ids) and min(ids) < 50 <= max(ids)


def test_tfparallel_runs_independent_instances(local_spark, tmp_path):
    from ember.compat.tfos import TFParallel

    def fn(args, ctx):
        with open(os.path.join(args, f"{ctx.worker_num}.json"), "w") as f:
            json.dump(dict(worker_num=ctx.worker_num, executor_id=ctx.executor_id,
                           num_workers=ctx.num_workers, defaultFS=ctx.defaultFS), f)

    TFParallel.run(local_spark.sparkContext, fn, str(tmp_path), 3)
    infos = sorted(read_json_files(str(tmp_path)), key=lambda i: i["worker_num"])
    assert [i["worker_num"] for i in infos] == [0, 1, 2]
    assert all(i["num_workers"] == 3 and i["defaultFS"] == "file://" for i in infos)


def test_dfutil_round_trip(local_spark, tmp_path):
    from pyspark.sql import Row

    spark = local_spark
    rows = [Row(a=i, b=i / 4, c=f"s{i}", d=bytearray(b"\x00\xff" + bytes([i])),
                e=[i, i + 1], f=[float(i), 0.5]) for i in range(40)]
    df = spark.createDataFrame(rows, "a long, b double, c string, d binary, e array<long>, "
                                     "f array<double>").repartition(3)
    path = str(tmp_path / "tfr")
    assert dfutil.saveAsTFRecords(df, path) == 40
    back = dfutil.loadTFRecords(spark.sparkContext, path, binary_features=["d"])
    assert dfutil.isLoadedDF(back)
    assert back.schema.simpleString() == ("struct<a:bigint,b:double,c:string,d:binary,"
                                          "e:array<bigint>,f:array<double>>")
    got = sorted(back.collect())
    assert [tuple(r) for r in got] == [(i, i / 4, f"s{i}", bytes(b"\x00\xff" + bytes([i])),
                                        [i, i + 1], [float(i), 0.5]) for i in range(40)]
    # toTFExample/fromTFExample: TFoS's (bytearray, None) records, checked against TF
    recs = df.rdd.mapPartitions(dfutil.toTFExample(df.dtypes)).collect()
    assert len(recs) == 40 and all(isinstance(r[0], bytearray) and r[1] is None for r in recs)
    rows2 = sorted(dfutil.fromTFExample(recs, ["d"]))
    assert [tuple(r) for r in rows2] == [tuple(r) for r in got]
    tf = pytest.importorskip("tensorflow")
    ex = tf.train.Example()
    ex.ParseFromString(bytes(recs[0][0]))
    assert ex.features.feature["c"].bytes_list.value[0].startswith(b"s")
    assert dfutil.infer_schema(ex, ["d"]) == back.schema


# --------------------------------------------------------------------------- Fashion-MNIST

@pytest.fixture(scope="module")
def fmnist():
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    from examples.fashion_mnist import data

    xtr, ytr = data.load_split("train")
    xte, yte = data.load_split("test")
    return (xtr[:TRAIN].reshape(TRAIN, 784), ytr[:TRAIN], xte[:TEST].reshape(TEST, 784),
            yte[:TEST])


def _args(tmp_path, **kw):
    a = argparse.Namespace(batch_size=64, epochs=2, learning_rate=2e-3, train_records=TRAIN,
                           model_dir=str(tmp_path / "model"), export_dir=str(tmp_path / "export"))
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _records(x, y):
    return [(x[i].tolist(), int(y[i])) for i in range(len(y))]


def _keras_mnist_spark(spark, tmp_path, fmnist):
    from tfos_programs import mnist_keras

    sc = spark.sparkContext
    xtr, ytr, xte, yte = fmnist
    images_labels = sc.parallelize(_records(xtr, ytr), 4)
    args = _args(tmp_path)
    cluster = TFCluster.run(sc, mnist_keras.main_fun, args, 2, num_ps=0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=120)
    cluster.train(images_labels, args.epochs + 1)
    cluster.shutdown(timeout=300)
    assert os.path.exists(os.path.join(args.export_dir, "saved_model.pb"))

    cluster = TFCluster.run(sc, mnist_keras.inference, args, 2, num_ps=0,
                            input_mode=TFCluster.InputMode.SPARK, reservation_timeout=120)
    try:
        results = cluster.inference(sc.parallelize(_records(xte, yte), 3)).collect()
    finally:
        cluster.shutdown(timeout=120)
    assert len(results) == TEST
    labels = np.array([r[0] for r in results])
    assert (labels == yte).all()  # in order, one result per record
    accuracy = float(np.mean([r[0] == r[1] for r in results]))
    print(f"InputMode.SPARK accuracy {accuracy:.3f}")
    assert accuracy > 0.65


def test_keras_mnist_input_mode_tensorflow_and_tfparallel(local_spark, tmp_path, fmnist):
    from ember.compat.tfos import TFParallel
    from tfos_programs import mnist_keras

    spark = local_spark
    sc = spark.sparkContext
    xtr, ytr, xte, yte = fmnist
    schema = "image array<long>, label long"
    train_dir, test_dir = str(tmp_path / "train"), str(tmp_path / "test")
    assert dfutil.saveAsTFRecords(spark.createDataFrame(_records(xtr, ytr), schema)
                                  .repartition(4), train_dir) == TRAIN
    assert dfutil.saveAsTFRecords(spark.createDataFrame(_records(xte, yte), schema)
                                  .repartition(3), test_dir) == TEST
    args = _args(tmp_path, images_labels=train_dir)
    cluster = TFCluster.run(sc, mnist_keras.main_fun_tf, args, 2, num_ps=0,
                            input_mode=TFCluster.InputMode.TENSORFLOW, master_node="chief",
                            reservation_timeout=120)
    cluster.shutdown(timeout=300)
    assert os.path.exists(os.path.join(args.export_dir, "saved_model.pb"))

    inf = _args(tmp_path, images_labels=test_dir, output=str(tmp_path / "predictions"))
    TFParallel.run(sc, mnist_keras.parallel_inference, inf, 2)
    pairs = [tuple(map(int, line.split()))
             for f in sorted(glob.glob(inf.output + "/part-*")) for line in open(f)]
    assert len(pairs) == TEST
    assert collections.Counter(p[0] for p in pairs) == collections.Counter(yte.tolist())
    accuracy = float(np.mean([a == b for a, b in pairs]))
    print(f"InputMode.TENSORFLOW accuracy {accuracy:.3f}")
    assert accuracy > 0.65


def test_pipeline_tfestimator_tfmodel(local_spark, tmp_path, fmnist):
    from ember.compat.tfos import pipeline
    from tfos_programs import mnist_keras

    spark = local_spark
    xtr, ytr, xte, yte = fmnist
    n_train = 2048

    def df_of(x, y):
        return spark.createDataFrame([((x[i] / 255.0).astype(float).tolist(), int(y[i]))
                                      for i in range(len(y))], "image array<float>, label long")

    est = (pipeline.TFEstimator(mnist_keras.pipeline_train_fn, {"unused": 1})
           .setInputMapping({"image": "image", "label": "label"})
           .setClusterSize(1).setEpochs(3).setBatchSize(256).setGraceSecs(0)
           .setExportDir(str(tmp_path / "export")).setModelDir(str(tmp_path / "model")))
    assert pipeline.TFEstimator(mnist_keras.pipeline_train_fn, {}).getGraceSecs() == 30
    model = est.fit(df_of(xtr[:n_train], ytr[:n_train]).repartition(2))
    tfmodel = (pipeline.TFModel({}).setInputMapping({"image": "image"})
               .setOutputMapping({"prediction": "scores"}).setSignatureDefKey("serving_default")
               .setTagSet("serve").setExportDir(str(tmp_path / "export")))
    assert model is not None
    rows = tfmodel.transform(df_of(xte, yte)).select("label", "scores").collect()
    assert len(rows) == TEST
    accuracy = float(np.mean([int(np.argmax(r.scores)) == r.label for r in rows]))
    print(f"pipeline accuracy {accuracy:.3f}")
    assert accuracy > 0.65


def test_pipeline_fit_gives_its_nodes_tf_keras_as_tfcluster_run(local_spark, tmp_path, fmnist,
                                                                 monkeypatch, caplog):
    """TFEstimator.fit starts its nodes as TFCluster.run does: with tf_keras
    (TF_USE_LEGACY_KERAS=1 where tf_keras is installed), so a train_fn written
    like TensorFlowOnSpark's pipeline example trains with only its imports
    changed; after the fit, the label the model does not take is an INFO line."""
    import tensorflow as tf
    from ember.compat.tfos import pipeline
    from tfos_programs import mnist_pipeline

    import ember.spark

    pytest.importorskip("tf_keras")
    caplog.set_level(logging.INFO, logger="ember")
    spark = local_spark
    sc = spark.sparkContext
    # nobody sets TF_USE_LEGACY_KERAS: not the driver, not the executors the nodes
    # inherit (earlier tests' programs set it in the Python workers Spark reuses:
    # mnist_keras.py does at import; one barrier task per slot takes every one)
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    assert sc.getConf().get("spark.executorEnv.TF_USE_LEGACY_KERAS", None) is None

    def forget(_):
        os.environ.pop("TF_USE_LEGACY_KERAS", None)
        yield os.environ.get("TF_USE_LEGACY_KERAS")

    slots = sc.defaultParallelism
    assert sc.parallelize(range(slots), slots).barrier().mapPartitions(forget).collect() \
        == [None] * slots
    # ... so the nodes' tf_keras comes from what fit passes to run(env=)
    passed = []
    real_run = ember.spark.run

    def spy(*args, **kwargs):
        passed.append(kwargs.get("env"))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(ember.spark, "run", spy)
    xtr, ytr, xte, yte = fmnist
    df = spark.createDataFrame([((xtr[i] / 255.0).astype(float).tolist(), int(ytr[i]))
                                for i in range(TRAIN)], "image array<float>, label long")
    est = (pipeline.TFEstimator(mnist_pipeline.train_fn, {"train_records": TRAIN})
           .setInputMapping({"image": "image", "label": "label"})
           .setClusterSize(1).setEpochs(2).setBatchSize(64).setGraceSecs(0)
           .setModelDir(str(tmp_path / "model")).setExportDir(str(tmp_path / "export")))
    model = est.fit(df.repartition(2))

    assert passed == [{"TF_USE_LEGACY_KERAS": "1"}]  # as TFCluster.run's nodes get
    with open(tmp_path / "model" / "keras-0.json") as f:
        assert json.load(f) == {"keras": "tf_keras.src.engine.sequential",
                                "TF_USE_LEGACY_KERAS": "1"}
    assert glob.glob(str(tmp_path / "model" / "weights-0002.index"))
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    scores = serve(image=tf.constant(xte.astype(np.float32) / 255.0))["prediction"].numpy()
    accuracy = float(np.mean(scores.argmax(axis=1) == yte))
    print(f"pipeline (tf_keras chosen by Ember) accuracy {accuracy:.3f}")
    assert accuracy > 0.65
    # the model takes the image only: said as information, not as an error
    assert model.getInputMapping() == {"image": "image"}
    [line] = [r for r in caplog.records if "transform() will not feed" in r.getMessage()]
    assert (line.name, line.levelno, line.getMessage()) == (
        "ember.ml", logging.INFO, "column label is not an input of signature "
        "'serving_default'; transform() will not feed it")


def _mnist_csv(directory, images, labels, parts=10):
    """The CSV input of TFoS's mnist examples (mnist_data_setup.py --format csv,
    written by saveAsTextFile): part files of ``label,pixel0,...,pixel783``
    lines; here of uneven sizes, so that the nodes' shares end at different
    times."""
    os.makedirs(directory)
    cuts = np.linspace(0, len(labels), parts + 1).astype(int)
    cuts[1:-1] += np.tile([-60, 60], parts)[:parts - 1]
    for k in range(parts):
        with open(os.path.join(directory, f"part-{k:05d}"), "w") as f:
            for i in range(cuts[k], cuts[k + 1]):
                f.write(",".join(map(str, [int(labels[i])] + images[i].astype(int).tolist())))
                f.write("\n")


def _run_mnist_spark_example(tmp_path, fmnist, master, confs=()):
    """Runs TFoS's examples/mnist/keras/mnist_spark.py (imports changed) as a
    script: 2 nodes, 3 epochs under MultiWorkerMirroredStrategy."""
    import subprocess
    import sys

    xtr, ytr, _, _ = fmnist
    data = str(tmp_path / "csv")
    _mnist_csv(data, xtr, ytr)
    here = os.path.dirname(os.path.abspath(__file__))
    shims = os.path.join(here, "tfos_programs", "tf1_shims")  # see its docstring
    # oneDNN's max-pooling gradient in TF 2.20 aborts the process on CPU
    # ("MklMaxPoolingGradOp ... int32 expected, got float"): TF's own kernels
    confs = ["spark.driver.host=127.0.0.1", "spark.driver.bindAddress=127.0.0.1",
             "spark.ui.enabled=false", f"spark.executorEnv.PYTHONPATH={shims}",
             "spark.executorEnv.TF_ENABLE_ONEDNN_OPTS=0", *confs]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=shims, TF_ENABLE_ONEDNN_OPTS="0",
               PYSPARK_SUBMIT_ARGS=" ".join(["--master", master]
                                            + [a for c in confs for a in ("--conf", c)]
                                            + ["pyspark-shell"]))
    env.pop("TF_USE_LEGACY_KERAS", None)  # ember.compat.tfos sets it for the nodes
    model_dir, export_dir = tmp_path / "model", tmp_path / "export"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "tfos_programs", "mnist_spark_tfos.py"),
         "--cluster_size", "2", "--epochs", "3", "--images_labels", data,
         "--model_dir", str(model_dir), "--export_dir", str(export_dir)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=540)
    took = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    fed = [ln[ln.index("ember.spark: train: fed"):] for ln in log.splitlines()
           if "INFO ember.spark: train: fed" in ln]
    assert fed, log[-6000:]
    assert glob.glob(str(export_dir / "*" / "saved_model.pb")), log[-3000:]
    assert glob.glob(str(model_dir / "weights-*")), log[-3000:]
    print(f"mnist_spark.py on {master}: {took:.0f} s; {fed[-1]}")


def test_tfos_mnist_spark_example_local(tmp_path, fmnist):
    """TensorFlowOnSpark's own example, imports changed: 3 epochs on local[2]
    (2 slots for 2 nodes' feeding tasks); it used to deadlock in epoch 2."""
    _run_mnist_spark_example(tmp_path, fmnist, "local[2]")


# --------------------------------------------------------------------------- standalone
# (last: switching to the standalone cluster stops the local session)

def test_standalone_feed_and_inference(cluster_spark, tmp_path):
    sc = cluster_spark.sparkContext
    rdd = sc.parallelize([(i, i) for i in range(200)], 3)
    cluster = TFCluster.run(sc, fp.count_feed, {"out": str(tmp_path)}, 2, 0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=120)
    assert cluster.train(rdd, 2) == 400
    cluster.shutdown(timeout=120)
    got = collections.Counter(i for info in _json(tmp_path).values() for i in info["ids"])
    assert got == collections.Counter({i: 2 for i in range(200)})
    cluster = TFCluster.run(sc, fp.square, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK,
                            reservation_timeout=120)
    try:
        out = cluster.inference(sc.parallelize([(i,) for i in range(300)], 3)).collect()
    finally:
        cluster.shutdown(timeout=120)
    assert [tuple(r) for r in out] == [(i, i * i) for i in range(300)]


def test_standalone_keras_mnist_input_mode_spark(cluster_spark, tmp_path, fmnist):
    """TensorFlowOnSpark's Keras example in InputMode.SPARK on executors of
    their own (its program on local Spark differs in nothing but the
    executors, which this cluster makes real): train, export, inference."""
    _keras_mnist_spark(cluster_spark, tmp_path, fmnist)


@pytest.mark.skipif(simcluster.available() is None,
                    reason="test_cluster.py runs this example on a standalone cluster of "
                           "simulated hosts (this loopback one is for machines without them)")
def test_tfos_mnist_spark_example_standalone(tmp_path, fmnist):
    """The same on its own standalone cluster of 2 one-slot executors."""
    from conftest import Standalone

    cluster = Standalone(str(tmp_path / "standalone"))
    os.makedirs(cluster.root)
    cluster.start()
    try:
        _run_mnist_spark_example(tmp_path, fmnist, cluster.url, [
            "spark.executor.cores=1", "spark.cores.max=2", "spark.executor.memory=768m",
            # start once both executors are there: the nodes' barrier stage needs 2 slots
            "spark.scheduler.minRegisteredResourcesRatio=1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime=90s"])
    finally:
        cluster.stop()
