"""ember.yarn.experiment.run_task on local Spark nodes (no YARN needed).

A Spark node's ``ctx`` is the same ``ember.node.NodeContext`` that
``ember.yarn.task`` hands to ``run_task`` in a YARN container, so these runs
exercise the experiment kinds exactly as run_on_yarn does, minus the launcher.

- Keras: chief + worker + evaluator on Fashion-MNIST; the chief checkpoints
  every epoch and exports; the evaluator follows the checkpoints; a second
  run on the same model_dir resumes from the latest checkpoint.
- PyTorch: DDP over gloo on 2 workers,
  and 2 training processes in one task (n_workers_per_executor=2).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
import uuid

import pytest

import yarn_experiment_fns as fns
from conftest import read_json_files
from ember.spark import InputMode, run


def _run(sc, experiment_fn, out, tasks, **kwargs):
    """Runs run_task on the nodes; waits for every task's result file (shutdown
    waits for the chief and workers only, and would stop the evaluator)."""
    os.makedirs(out)
    cluster = run(sc, fns.run_experiment, {"experiment_fn": experiment_fn, "out": str(out)},
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120, **kwargs)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and any(
                not os.path.exists(os.path.join(out, f"{t.replace(':', '-')}.json"))
                for t in tasks):
            if getattr(cluster, "_failures", None):  # a node failed: shutdown raises it
                break
            time.sleep(1)
    finally:
        cluster.shutdown(timeout=600)  # raises a node's failure
    results = {f"{r['task']}": r for r in read_json_files(str(out))}
    for task, r in sorted(results.items()):  # shown by pytest -rP
        print(f"RESULT {task} metrics={json.dumps(r['metrics'])} timings={r['timings']}")
    return results

_KERAS_TASKS = ["chief:0", "worker:0", "evaluator:0"]

# marks, not importorskip in the body: a skipped test must not start Spark or Hadoop
needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                              reason="tensorflow is not installed (requirements.txt pins it)")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (requirements.txt pins it)")


@needs_tf
def test_keras_experiment_chief_worker_evaluator_and_resume(local_spark, tmp_path):
    sc = local_spark.sparkContext
    model_dir = str(tmp_path / "model")

    # run 1: 2 of the 4 epochs (as if the application had stopped there)
    first = _run(sc, functools.partial(fns.keras_fmnist, model_dir, epochs=2),
                 tmp_path / "run1", _KERAS_TASKS, num_executors=3, master_node="chief",
                 eval_node=True)
    assert sorted(first) == ["chief:0", "evaluator:0", "worker:0"]
    chief, worker, evaluator = first["chief:0"], first["worker:0"], first["evaluator:0"]
    assert (chief["rank"], worker["rank"], chief["size"]) == (0, 1, 2)
    assert chief["initial_epoch"] == worker["initial_epoch"] == 0
    assert chief["shard_rows"] == worker["shard_rows"] == 30000  # 60,000 shared by 2 ranks
    # different initial weights (seeded by RANK): equal only through Ember
    assert chief["weights_sha256"] == worker["weights_sha256"]
    assert chief["history"] == worker["history"]  # logs averaged over the ranks
    assert len(chief["history"]["loss"]) == 2
    assert chief["history"]["loss"][1] < chief["history"]["loss"][0]
    assert [e["epoch"] for e in evaluator["evaluations"]] == [1, 2]
    assert evaluator["epochs"] == 2 and evaluator["metrics"]["accuracy"] > 0.80, evaluator

    names = sorted(os.listdir(model_dir))
    assert names == ["ckpt-00001.keras", "ckpt-00002.keras", "eval", "export"], names
    with open(os.path.join(model_dir, "export", "export.json")) as f:
        assert json.load(f)["epoch"] == 2
    assert os.path.isfile(os.path.join(model_dir, "export", "saved_model", "saved_model.pb"))
    assert os.path.isfile(os.path.join(model_dir, "export", "model.keras"))
    assert sorted(os.listdir(os.path.join(model_dir, "eval"))) == ["ckpt-00001.json",
                                                                   "ckpt-00002.json"]

    # run 2, same model_dir, 4 epochs: resumes at epoch 2 and trains 2 more
    second = _run(sc, functools.partial(fns.keras_fmnist, model_dir, epochs=4),
                  tmp_path / "run2", _KERAS_TASKS, num_executors=3, master_node="chief",
                  eval_node=True)
    chief, worker, evaluator = second["chief:0"], second["worker:0"], second["evaluator:0"]
    assert chief["initial_epoch"] == worker["initial_epoch"] == 2
    assert len(chief["history"]["loss"]) == 2  # epochs 3 and 4 only
    assert chief["weights_sha256"] == worker["weights_sha256"]
    # the evaluator skipped epochs 1-2 (model_dir/eval) and saw 3 and 4
    assert [e["epoch"] for e in evaluator["evaluations"]] == [3, 4]
    assert evaluator["epochs"] == 4
    accuracy = evaluator["metrics"]["accuracy"]
    assert accuracy >= 0.85, accuracy  # the final model on the 10,000 test images
    # the final metrics are those of the chief's final weights: check them here
    import keras
    from yarn_experiment_fns import _images

    model = keras.models.load_model(os.path.join(model_dir, "export", "model.keras"))
    x, y = _images("test")
    pred = model.predict(x, batch_size=1000, verbose=0).argmax(1)
    assert abs(float((pred == y).mean()) - accuracy) < 1e-6


@needs_tf
def test_keras_experiment_bad_input_names_the_problem(tmp_path, monkeypatch):
    from ember.yarn.experiment import run_task

    # in process: test_ml.py sets TF_USE_LEGACY_KERAS for the whole session,
    # and run_task refuses Keras 3 experiments under it (checked first)
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)

    class Ctx:  # run_task checks the experiment before touching the cluster
        job_name, task_index = "chief", 0

        def absolute_path(self, path):
            return path

    def uncompiled():
        import keras

        from ember.yarn.experiment import KerasExperiment

        return KerasExperiment(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
                               str(tmp_path), {"epochs": 1})

    with pytest.raises(ValueError, match="not compiled"):
        run_task(uncompiled, Ctx())
    with pytest.raises(TypeError, match="expected a KerasExperiment, a PytorchExperiment"):
        run_task(lambda: 42, Ctx())
    Ctx.job_name = "tensorboard"
    with pytest.raises(ValueError, match="task type 'tensorboard'"):
        run_task(uncompiled, Ctx())
    Ctx.job_name = "ps"
    assert run_task(uncompiled, Ctx())["kind"] == "ps"  # nothing to serve, no model built


@needs_tf
def test_keras_experiment_hdfs_model_dir(hadoop_cluster, monkeypatch):
    """Checkpoints, export, evaluations and resume on an hdfs:// model_dir
    (one rank in this process; the protocol is the same with more)."""
    from ember import hdfs
    from ember.collective import Collective
    from ember.yarn.experiment import run_task

    monkeypatch.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
    monkeypatch.setenv("HADOOP_USER_NAME", hadoop_cluster.user)
    url = hadoop_cluster.hdfs_url(f"/yarn-experiment/{uuid.uuid4().hex[:8]}/model")

    class Ctx:
        task_index = 0
        cluster_spec = {"chief": ["127.0.0.1:1"]}  # no ps: the collective's path

        def __init__(self, job_name):
            self.job_name = job_name

        def absolute_path(self, path):
            return path

        def report_progress(self, text):
            pass

    chief = Ctx("chief")
    with Collective(0, ["127.0.0.1:1"], os.urandom(32)) as chief.collective:
        first = run_task(functools.partial(fns.keras_tiny, url, epochs=2), chief)
        assert first["initial_epoch"] == 0 and len(first["history"]["loss"]) == 2
        assert hdfs.listdir(url) == ["ckpt-00001.keras", "ckpt-00002.keras", "export"]
        assert sorted(hdfs.listdir(url + "/export")) == ["export.json", "model.keras",
                                                        "saved_model"]
        evaluator = run_task(functools.partial(fns.keras_tiny, url, epochs=2), Ctx("evaluator"))
        assert [e["epoch"] for e in evaluator["evaluations"]] == [1, 2]
        assert hdfs.listdir(url + "/eval") == ["ckpt-00001.json", "ckpt-00002.json"]
        assert evaluator["metrics"]["accuracy"] > 0.9, evaluator

        second = run_task(functools.partial(fns.keras_tiny, url, epochs=3), chief)
        assert second["initial_epoch"] == 2 and len(second["history"]["loss"]) == 1
    evaluator = run_task(functools.partial(fns.keras_tiny, url, epochs=3), Ctx("evaluator"))
    assert [e["epoch"] for e in evaluator["evaluations"]] == [3]
    assert evaluator["epochs"] == 3
    assert json.loads(hdfs.read_bytes(url + "/export/export.json"))["epoch"] == 3


@needs_torch
def test_pytorch_experiment_ddp_two_workers(local_spark, tmp_path):
    """DDP's ranks, steps and replicas on Spark nodes, on 8,192 images for 2
    epochs: the same experiment reaches the 0.85 bar on all the data in
    test_yarn_experiments.py, in YARN containers."""
    results = _run(local_spark.sparkContext,
                   functools.partial(fns.torch_fmnist, epochs=2, rows=8192),
                   tmp_path / "out", ["chief:0", "worker:0"], num_executors=2, master_node="chief")
    assert sorted(results) == ["chief:0", "worker:0"]
    a, b = results["chief:0"], results["worker:0"]
    assert (a["rank"], b["rank"], a["world_size"]) == (0, 1, 2)
    assert a["device"] == "cpu"
    # DistributedSampler: each rank 4,096 images a pass, 64 full batches of 64
    assert a["metrics"]["steps"] == b["metrics"]["steps"] == 2 * (4096 // 64)
    assert a["metrics"]["params_sha256"] == b["metrics"]["params_sha256"]  # DDP replicas
    assert a["metrics"]["accuracy"] == b["metrics"]["accuracy"]
    assert a["metrics"]["accuracy"] >= 0.6, a["metrics"]  # chance is 0.1


@needs_torch
def test_pytorch_experiment_two_processes_per_task(local_spark, tmp_path):
    fn = functools.partial(fns.torch_fmnist, epochs=1, rows=4096, n_workers_per_executor=2)
    results = _run(local_spark.sparkContext, fn, tmp_path / "out", ["chief:0"], num_executors=1,
                   master_node="chief")
    chief = results["chief:0"]
    procs = chief["processes"]
    assert [(p["rank"], p["local_rank"], p["world_size"]) for p in procs] == [(0, 0, 2),
                                                                              (1, 1, 2)]
    assert procs[0]["metrics"]["steps"] == procs[1]["metrics"]["steps"] == 2048 // 64
    assert procs[0]["metrics"]["params_sha256"] == procs[1]["metrics"]["params_sha256"]
