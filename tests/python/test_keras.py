"""Keras 3 model.fit on 2 Spark nodes through ember.spark.run and ember.keras.

Keras 3 does not work with MultiWorkerMirroredStrategy (keras-team/keras#20585);
ember.keras averages each step's gradients on Ember's collective.  The nodes
start from different random weights and train on different shards, so their
weights are identical after every epoch only if the initial broadcast and the
gradient averaging work.
"""

from __future__ import annotations

import collfuns
from conftest import read_json_files
from ember.spark import InputMode, run


def test_keras3_fit_on_two_workers_keeps_replicas_identical(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, collfuns.keras_fit, {"out": str(tmp_path), "n": 4096, "epochs": 3},
                  num_executors=2, master_node=None, input_mode=InputMode.TENSORFLOW,
                  reservation_timeout=120)
    cluster.shutdown(timeout=300)
    a, b = sorted(read_json_files(str(tmp_path)), key=lambda i: i["rank"])
    assert (a["rank"], b["rank"], a["size"]) == (0, 1, 2)
    for node in (a, b):
        assert node["keras"].startswith("3.") and node["legacy"] is None
        assert node["shard"] == 2048
        assert len(node["epochs"]) == 3
    # different starts and data: only Ember's broadcast + averaging make them agree
    assert a["initial"] != b["initial"]
    assert a["first_label"] != b["first_label"] or a["shard"] == 0
    assert a["epochs"] == b["epochs"]  # bit-identical weights after every epoch
    assert len(set(a["epochs"])) == 3  # and they did change
    assert a["loss"] == b["loss"]  # averaged logs
    assert a["loss"][-1] < a["loss"][0]
    assert a["accuracy"] == b["accuracy"] and a["accuracy"] > 0.75, a["accuracy"]
