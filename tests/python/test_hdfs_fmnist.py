"""Fashion-MNIST on HDFS, end to end (issue: "Hadoop for real"):

1. Spark writes the 60,000 training records as TFRecords to the mini HDFS
   (ember.tfrecord.save to hdfs://, through examples/fashion_mnist/data.py);
2. ember.spark.run trains in InputMode.TENSORFLOW on 2 nodes, each reading
   its shard from HDFS with libember's WebHDFS reader (tests/python/hdfs_fmnist.py);
3. the chief writes checkpoints, a SavedModel and a TensorBoard log to HDFS;
4. here the SavedModel is read back from HDFS and scores the 10,000 test
   images: accuracy >= 0.85.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
from hadoop_fixture import HadoopCluster

pytestmark = pytest.mark.timeout(900)

EPOCHS = int(os.environ.get("EMBER_HDFS_FMNIST_EPOCHS", "2"))


def test_fashion_mnist_tfrecords_on_hdfs(hadoop_cluster: HadoopCluster, local_spark, tmp_path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.fashion_mnist import data

    import hdfs_fmnist
    from ember import hdfs, tfrecord
    from ember.spark import InputMode, run

    monkeypatch.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
    monkeypatch.setenv("HADOOP_USER_NAME", hadoop_cluster.user)
    base = hadoop_cluster.hdfs_url("/fmnist")
    sc = local_spark.sparkContext
    images, labels = data.load_split("train")
    n = data.to_tfrecords(local_spark, images, labels, base + "/tfrecords/train", 4)
    assert n == 60000
    parts = [p for p in hdfs.listdir(base + "/tfrecords/train") if p.startswith("part-")]
    assert len(parts) == 4 and hdfs.exists(base + "/tfrecords/train/_SUCCESS")

    args = argparse.Namespace(
        data_url=base + "/tfrecords/train", model_url=base + "/model",
        export_url=base + "/export", tb_url=base + "/tensorboard", epochs=EPOCHS,
        batch_size=64, learning_rate=1e-3, steps_per_epoch=0, train_records=n,
        intra_op_threads=1, inter_op_threads=1)
    cluster = run(sc, hdfs_fmnist.train_hdfs, args, num_executors=2, num_ps=0,
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120,
                  env={"HADOOP_CONF_DIR": hadoop_cluster.conf_dir,
                       "HADOOP_USER_NAME": hadoop_cluster.user})
    cluster.shutdown(timeout=600)

    # checkpoints (the last two kept) and the SavedModel are on HDFS
    ckpts = hdfs.listdir(base + "/model/checkpoint")
    steps_per_epoch = n // 128
    assert "checkpoint" in ckpts
    assert f"ckpt-{EPOCHS * steps_per_epoch}.index" in ckpts
    assert {"saved_model.pb", "variables"} <= set(hdfs.listdir(base + "/export"))
    assert any(name.startswith("events.out.tfevents") for name in hdfs.listdir(base + "/tensorboard"))

    # the SavedModel, read back from HDFS, on the test set
    local = hdfs.download(base + "/export", str(tmp_path / "export"))
    import tensorflow as tf

    serve = tf.saved_model.load(local).signatures["serving_default"]
    test_x, test_y = data.load_split("test")
    x = (test_x.reshape(-1, 784).astype(np.float32) / 255.0)
    classes = serve(image=tf.constant(x))["classes"].numpy()
    accuracy = float(np.mean(classes == test_y))
    print(f"HDFS Fashion-MNIST: {EPOCHS} epoch(s), test accuracy {accuracy:.4f}")
    assert accuracy >= 0.85
    # the TFRecords also load back as a DataFrame straight from HDFS
    assert tfrecord.load(local_spark, base + "/tfrecords/train").count() == 60000
