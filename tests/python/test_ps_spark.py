"""Ember's parameter server on Spark: ``run(..., num_ps=2,
parameter_servers=ParameterServers())`` on the shared local session: the ps
nodes serve shards without user code and end when the workers finished; a
Keras 3 model trains asynchronously on them (ember.keras.parameter_servers),
and a click model keeps a 1,000,000-row embedding table on them, moving only
the rows its batches touch."""

from __future__ import annotations

import pytest

import psfuns
import simcluster
from ember.ps import ParameterServers
from ember.spark import InputMode, run

#: test_cluster.py's parameter-server test runs these jobs across the
#: simulated hosts, with more nodes; here they run for machines without them
#: (about 85 CPU seconds of make test's two cores otherwise spent twice)
ON_HOSTS = pytest.mark.skipif(
    simcluster.available() is None,
    reason="test_cluster.py's parameter-server test runs this job across the simulated hosts")


def test_keras_trains_asynchronously_on_two_ps_shards(local_spark, tmp_path):
    # items of 8 floats and users of 4 (a Keras Embedding the servers hold too)
    nodes = psfuns.train_async_on_two_shards(local_spark.sparkContext, psfuns.keras_async,
                                             str(tmp_path), 8 + 4)
    for node in nodes.values():
        assert node["users_on_servers"] == "clicks/users/embeddings"
        # local Spark: every shard is on the worker's host, so shared memory
        assert node["transports"] == ["shm", "shm"], node["transports"]


@ON_HOSTS
def test_a_killed_ps_is_named_and_the_job_resumes_from_the_ps_checkpoints(local_spark, tmp_path):
    """SIGKILL a ps node mid-training with max_restarts=1: the restart names
    it, the restarted shards restore their checkpoints (written every
    second), the chief's fresh initial weights leave the trained rows alone,
    and the job trains on to the end."""
    import json
    import os
    import signal
    import time

    sc = local_spark.sparkContext
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    cluster = run(sc, psfuns.keras_restart, {"out": str(out), "n": 8192, "epochs": 3},
                  num_executors=4, num_ps=2, input_mode=InputMode.TENSORFLOW,
                  parameter_servers=ParameterServers(checkpoint_dir=str(ckpt),
                                                     checkpoint_secs=1.0),
                  max_restarts=1, reservation_timeout=120)
    try:
        victim = next(n for n in cluster.nodes if n["role"] == "ps" and n["task_index"] == 1)
        deadline = time.monotonic() + 120
        while not (out / "started-0-0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.5)  # a checkpoint or two
        os.kill(victim["pid"], signal.SIGKILL)
    finally:
        cluster.shutdown(timeout=300)
    assert cluster.restarts == 1
    cause = cluster.restart_causes[0]
    assert cause.node == victim["index"] and "ps:1" in str(cause), str(cause)[:400]
    assert sorted(os.listdir(ckpt)) == ["ps-0-of-2.ckpt", "ps-1-of-2.ckpt"]
    first = json.loads((out / "attempt-1-0.json").read_text())
    # the second attempt started from the restored, trained weights, not
    # from the chief's fresh ones (about 0.1 on ten classes)
    assert first["start"] > 0.6, first
    assert first["end"] > 0.75, first
    assert not (out / "attempt-0-0.json").exists()  # the first attempt never finished


@ON_HOSTS
def test_tensorflow_parameter_server_strategy_runs_as_written(local_spark, tmp_path):
    """Existing TF2 parameter-server code (tf_keras, ClusterCoordinator,
    dataset_fn on TFRecords) on an Ember cluster in InputMode.TENSORFLOW:
    the ps and worker nodes run tf.distribute.Server until shutdown stops
    them after the chief is done."""
    import json

    import numpy as np

    from examples.fashion_mnist.data import load_split, to_tfrecords

    sc = local_spark.sparkContext
    images, labels = load_split("train")
    data = str(tmp_path / "tfrecords")
    to_tfrecords(local_spark, images[:12000], labels[:12000], data, 4)
    out = tmp_path / "out"
    out.mkdir()
    cluster = run(sc, psfuns.tf_parameter_server_strategy,
                  {"out": str(out), "data": data, "epochs": 2, "steps": 150},
                  num_executors=3, num_ps=1, input_mode=InputMode.TENSORFLOW,
                  env={"TF_USE_LEGACY_KERAS": "1"}, reservation_timeout=120)
    cluster.shutdown(timeout=600)
    chief = json.loads((out / "chief.json").read_text())
    assert chief["workers"] == 1
    assert chief["accuracy"] > 0.75, chief
    assert np.isfinite(chief["accuracy"])


def test_tensorflow_parameter_server_strategy_reads_the_spark_feed(local_spark, tmp_path):
    """ParameterServerStrategy in InputMode.SPARK: the worker's dataset_fn,
    traced on the chief, reads the rows Spark feeds that worker through
    Ember's TensorFlow op; the chief, which only coordinates, is not fed
    (feed_chief=False).  Spark feeds exactly what the steps take, so every
    partition is delivered whole and train() returns."""
    import json

    import numpy as np

    from examples.fashion_mnist.data import load_split

    sc = local_spark.sparkContext
    images, labels = load_split("train")
    epochs, steps, batch = 2, 150, 64
    n = epochs * steps * batch
    x = images[:n].reshape(n, -1).astype(np.float32) / 255.0
    rows = sc.parallelize([(x[i], int(labels[i])) for i in range(n)], 4)
    out = tmp_path / "out"
    out.mkdir()
    cluster = run(sc, psfuns.tf_parameter_server_strategy_fed,
                  {"out": str(out), "epochs": epochs, "steps": steps, "batch": batch},
                  num_executors=3, num_ps=1, input_mode=InputMode.SPARK, feed_chief=False,
                  env={"TF_USE_LEGACY_KERAS": "1"}, reservation_timeout=120)
    assert cluster.train(rows, feed_timeout=300) == n
    cluster.shutdown(timeout=600)
    chief = json.loads((out / "chief.json").read_text())
    assert chief["accuracy"] > 0.75, chief
