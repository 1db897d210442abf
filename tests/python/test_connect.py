"""Ember from a Spark Connect client (ember.connect) against a real Spark
Connect server on local[4] (the shared ``connect_server``).  Each client is a
process of its own that starts no JVM (connect_client.py checks it): a
restart that resumes from the nodes' checkpoints, and an EmberEstimator ->
EmberModel Pipeline fit, transformed, saved and loaded.

Elsewhere, against standalone clusters: the main job in both input modes
over Connect on the simulated hosts (test_cluster.py), and a node SIGKILLed
mid-feed on a cluster with as many slots as nodes (test_standalone.py)."""

from __future__ import annotations

from connect_fixture import run_client


def test_restart_resumes_from_the_checkpointed_epoch_over_connect(connect_server, tmp_path):
    record = run_client("restart", connect_server, str(tmp_path), 300)
    n, epochs = record["n"], record["epochs"]
    assert record["killed"] and record["restarts"] == 1 and record["cause_node"] == 1, record
    assert record["runs"] == [[0, 0], [0, 1], [1, 0], [1, 1]], record
    # each restarted node resumed from its own checkpoint (at least epoch 1),
    # and the feed restarted from the smaller of the two
    assert record["starts"] == record["ckpts"] and min(record["starts"]) >= 1, record
    resume = min(record["starts"])
    expected = {str(e): (n if e >= resume else 0) for e in range(epochs)}
    assert record["after"] == expected, record
    assert record["fed"] == (epochs - resume) * n and record["before"]["0"] == n, record


def test_ember_estimator_and_model_in_a_pipeline_over_connect(connect_server, tmp_path):
    record = run_client("pipeline", connect_server, str(tmp_path), 600)
    assert record["model"] == "EmberModel" and record["rows"] == 10000, record
    assert record["accuracy"] >= 0.75, record  # 15,000 rows, 2 epochs: far above chance
    assert record["same"] is True, record  # the loaded PipelineModel predicts the same
