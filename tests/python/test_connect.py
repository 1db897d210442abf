"""Ember from a Spark Connect client (ember.connect) against a real Spark
Connect server on local[4] (the shared ``connect_server``).  Each client is a
process of its own that starts no JVM (connect_client.py checks it): the main
job in both input modes to its accuracy bar, a node SIGKILLed mid-feed raised
in the client naming the node, a restart that resumes from the nodes'
checkpoints, and an EmberEstimator -> EmberModel Pipeline fit, transformed,
saved and loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _client(scenario: str, server: Any, out: str, timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "connect_client.py"), scenario,
                           server.url, out], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    path = os.path.join(out, f"{scenario}.json")
    assert proc.returncode == 0 and os.path.exists(path), \
        f"client exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}" \
        f"\n(server log: {server.log_path})"
    record = json.load(open(path))
    # a Connect client: no py4j gateway, no java child process
    assert record["gateway"] is False and record["java_children"] == [], record
    return dict(record)


def test_main_job_both_input_modes_over_connect(connect_server, tmp_path):
    record = _client("main", connect_server, str(tmp_path), 600)
    assert record["code"] == 0, record
    modes = {}
    for line in record["results"]:
        fields = dict(kv.split("=", 1) for kv in line.split()[2:])
        modes[fields["mode"]] = float(fields["accuracy"])
    assert set(modes) == {"spark", "tensorflow"}, record
    assert min(modes.values()) >= 0.85, modes


def test_a_killed_node_is_raised_in_the_client_naming_it(connect_server, tmp_path):
    """Also: a peer with a wrong secret and one sending garbage at the
    coordinator's control channel change nothing."""
    record = _client("kill", connect_server, str(tmp_path), 300)
    # strangers at the coordinator's control channel were refused, and the
    # cluster served on (the feed ran until the kill)
    assert record["strangers"][0] == "EmberAuthError", record
    assert record["raised"] == "EmberNodeError" and record["node"] == 1, record
    assert "ember node 1 (worker:0" in record["message"], record
    assert record["after_kill"] < 20, record


def test_restart_resumes_from_the_checkpointed_epoch_over_connect(connect_server, tmp_path):
    record = _client("restart", connect_server, str(tmp_path), 300)
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
    record = _client("pipeline", connect_server, str(tmp_path), 600)
    assert record["model"] == "EmberModel" and record["rows"] == 10000, record
    assert record["accuracy"] >= 0.8, record
    assert record["same"] is True, record  # the loaded PipelineModel predicts the same
