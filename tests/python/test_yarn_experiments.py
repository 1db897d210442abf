"""tf-yarn's experiment kinds through run_on_yarn on the mini YARN.

The experiments are ember.yarn.experiment's (their bodies are shared with the
local-Spark tests: yarn_experiment_fns.py).  The containers run the
tests' own interpreter (the venv with TensorFlow and torch).  Each test is one or two applications of 2-3 training
containers (~1-2 min on 2 cores).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest

from hadoop_fixture import REPO, HadoopCluster
from ember import hdfs
from ember.yarn import TaskSpec, run_on_yarn

HERE = os.path.dirname(os.path.abspath(__file__))
# the containers import the experiment functions (yarnfuns, yarn_experiment_fns)
# and the Fashion-MNIST loader (examples/)
ENV = {"PYTHONPATH": os.pathsep.join([HERE, REPO])}
SPEC = TaskSpec("2 GiB", 1)


def test_keras_fashion_mnist_chief_worker_evaluator_resumes_after_a_failure(
        yarn: HadoopCluster) -> None:
    pytest.importorskip("tensorflow", reason="the Keras path runs in the main .venv")
    import yarnfuns

    model_dir = yarn.hdfs_url(f"/user/{yarn.user}/yarn-keras-fmnist")
    m = run_on_yarn(functools.partial(yarnfuns.keras_fails_once, model_dir, 3),
                    {"chief": SPEC, "worker": SPEC, "evaluator": SPEC}, env=ENV,
                    nb_retries=1, name="ember-test-keras", timeout=900)
    assert m.attempts == 2  # attempt 1 failed on purpose after epoch 1
    chief, worker, ev = (m[t].metrics for t in ("chief:0", "worker:0", "evaluator:0"))
    assert chief["attempt"] == worker["attempt"] == ev["attempt"] == 2
    # attempt 2 resumed from the checkpoint attempt 1's chief wrote after epoch 1
    assert chief["initial_epoch"] == worker["initial_epoch"] == 1
    assert chief["epochs"] == 3 and len(chief["history"]["loss"]) == 2
    assert (chief["rank"], worker["rank"], chief["size"]) == (0, 1, 2)
    assert chief["weights_sha256"] == worker["weights_sha256"]  # replicas identical
    # the evaluator's score of the final model on the 10,000 test images
    print(f"\n[keras on YARN] evaluator accuracy {ev['metrics']['accuracy']:.4f}, "
          f"{m.wall_s:.0f} s for 2 applications")
    assert ev["epochs"] == 3 and ev["metrics"]["accuracy"] >= 0.85, ev["metrics"]
    export = json.loads(hdfs.read_bytes(model_dir + "/export/export.json"))
    assert export["epoch"] == 3
    assert hdfs.isfile(model_dir + "/export/saved_model/saved_model.pb")


def test_pytorch_ddp_fashion_mnist_two_workers(yarn: HadoopCluster) -> None:
    pytest.importorskip("torch", reason="torch is not installed (requirements.txt pins it)")
    import yarn_experiment_fns as fns

    m = run_on_yarn(functools.partial(fns.torch_fmnist, epochs=3),
                    {"worker": TaskSpec("2 GiB", 1, instances=2)}, env=ENV,
                    python=sys.executable,
                    name="ember-test-torch", timeout=900)
    a, b = m["worker:0"].metrics, m["worker:1"].metrics
    assert (a["rank"], b["rank"], a["world_size"]) == (0, 1, 2)
    assert a["kind"] == "pytorch" and a["device"] == "cpu"
    assert a["metrics"]["params_sha256"] == b["metrics"]["params_sha256"]  # DDP in step
    print(f"\n[pytorch on YARN] accuracy {a['metrics']['accuracy']:.4f}, {m.wall_s:.0f} s")
    assert a["metrics"]["accuracy"] >= 0.85, a["metrics"]
    assert m["worker:0"].container != m["worker:1"].container


def test_keras_on_ps_strategy_topology_trains_on_embers_parameter_servers(
        yarn: HadoopCluster) -> None:
    """tf-yarn's ps_strategy_topology: the ps task serves a shard of Ember's
    parameter server and the chief and worker train on it asynchronously,
    ending with the same (the servers') weights."""
    pytest.importorskip("tensorflow", reason="the Keras path runs in the main .venv")
    import yarn_experiment_fns as fns

    from ember.yarn import ps_strategy_topology

    model_dir = yarn.hdfs_url(f"/user/{yarn.user}/yarn-keras-ps")
    m = run_on_yarn(functools.partial(fns.keras_fmnist, model_dir, 2),
                    ps_strategy_topology(nb_workers=1, nb_ps=1, memory=2048, vcores=1),
                    env=ENV, name="ember-test-keras-ps", timeout=900)
    chief, worker = m["chief:0"].metrics, m["worker:0"].metrics
    assert (chief["rank"], worker["rank"], chief["size"]) == (0, 1, 2)
    # different seeds, asynchronous steps: equal only through the servers
    assert chief["weights_sha256"] == worker["weights_sha256"]
    assert chief["history"]["loss"][-1] < chief["history"]["loss"][0]
    assert chief["history"]["accuracy"][-1] > 0.8, chief["history"]
    assert hdfs.isfile(model_dir + "/export/model.keras")
    assert "ps:0" in m.tasks
