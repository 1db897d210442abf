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
        # each step pulled the rows of its batch (at most 128 of 8 floats)
        # and the click model's dense weights, never the 32 MB table
        per_step = node["clicks_received"] / node["clicks_steps"]
        assert 0 < per_step < 128 * 8 * 4 + 4096, per_step
        assert node["clicks_received"] < node["table_bytes"] / 20
    # both started from the chief's weights, whatever their own seeds, and
    # ended with the servers' final weights
    assert chief["start"] == worker["start"]
    assert chief["final"] == worker["final"] != chief["start"]
