"""Ember's parameter server on Spark: ``run(..., num_ps=2,
parameter_servers=ParameterServers())`` on the shared local session: the ps
nodes serve shards without user code and end when the workers finished; a
Keras 3 model trains asynchronously on them (ember.keras.parameter_servers),
and a click model keeps a 1,000,000-row embedding table on them, moving only
the rows its batches touch."""

from __future__ import annotations

import psfuns
from conftest import read_json_files
from ember.ps import ParameterServers
from ember.spark import InputMode, run


def test_keras_trains_asynchronously_on_two_ps_shards(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, psfuns.keras_async, {"out": str(tmp_path), "n": 8192, "epochs": 3},
                  num_executors=4, num_ps=2, parameter_servers=ParameterServers(),
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120)
    cluster.shutdown(timeout=300)
    chief, worker = sorted(read_json_files(str(tmp_path)), key=lambda i: i["rank"])
    assert (chief["role"], worker["role"]) == ("chief", "worker")
    for node in (chief, worker):
        assert (node["size"], node["shards"]) == (2, 2)
        assert node["loss"][-1] < node["loss"][0]
        assert node["accuracy"] > 0.75, node["accuracy"]
        # the click model learned from its embedding rows alone
        assert node["clicks_accuracy"] > 0.9, node["clicks_accuracy"]
        # each step pulled the rows of its batch (at most 128 items of 8
        # floats and 128 users of 4) and the dense weights, never the 32 MB table
        per_step = node["clicks_received"] / node["clicks_steps"]
        assert 0 < per_step < 128 * (8 + 4) * 4 + 4096, per_step
        assert node["users_on_servers"] == "clicks/users/embeddings"
        assert node["clicks_received"] < node["table_bytes"] / 20
    # both started from the chief's weights, whatever their own seeds, and
    # ended with the servers' final weights
    assert chief["start"] == worker["start"]
    assert chief["final"] == worker["final"] != chief["start"]


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
    to_tfrecords(sc, images[:12000], labels[:12000], data, 4)
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
