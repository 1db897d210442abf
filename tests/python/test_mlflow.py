"""ember.mlflow against a real MLflow tracking server (``mlflow server``, a
SQLite backend and a local artifact root, started by this module), read back
through MLflow's client: ember.spark.run's params, the chief's per-epoch
metrics, the exported model, a restart and a failure; EmberEstimator.fit;
run_on_yarn on the mini YARN and its failure logging; and no tracking (and no
mlflow import) without MLFLOW_TRACKING_URI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

pytest.importorskip("mlflow", reason="mlflow is pinned in requirements.txt; `make setup` installs it")

import mlflow_funs  # noqa: E402
from conftest import free_port  # noqa: E402
from ember.spark import EmberNodeError, InputMode, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _server_python() -> str:
    """The Python that runs ``mlflow server``: make setup's .venv-mlflow (the
    full mlflow, kept out of the main venv, which has the client only), else
    this one if it has the server's packages."""
    venv = os.path.join(REPO, ".venv-mlflow", "bin", "python")
    if os.access(venv, os.X_OK):
        return venv
    import importlib.util

    if importlib.util.find_spec("flask") and importlib.util.find_spec("sqlalchemy"):
        return sys.executable
    pytest.skip("no MLflow server to test against: `make setup` installs one in .venv-mlflow "
                "(requirements-mlflow-server.txt)")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free loopback port; stopped (its process group) at the end."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [_server_python(), "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{root}/mlflow.db", "--default-artifact-root", f"file://{root}/artifacts",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # no server-side job runner (huey consumers, which polled for jobs
        # Ember never submits: about 60 CPU seconds of make test's two cores)
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start; log in {root}/server.log")
            time.sleep(0.3)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    """MLFLOW_TRACKING_URI at the server, a fresh experiment; the client."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"ember-test-{uuid.uuid4().hex[:8]}")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return MlflowClient(mlflow_server)


def _runs(client):
    exp = client.get_experiment_by_name(os.environ["MLFLOW_EXPERIMENT_NAME"])
    return client.search_runs([exp.experiment_id]) if exp is not None else []


def _history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                              key=lambda m: m.step)]


def test_run_logs_params_epoch_metrics_model_and_a_restart(local_spark, tracking, tmp_path):
    client = tracking
    cluster = run(local_spark.sparkContext, mlflow_funs.train_epochs,
                  {"out": str(tmp_path), "fail_once": True, "lr": 0.5}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, max_restarts=1, reservation_timeout=60)
    cluster.shutdown(timeout=60)
    assert cluster.restarts == 1
    runs = _runs(client)
    assert [r.info.run_id for r in runs] == [cluster.mlflow_run_id]  # one run for the job
    r = client.get_run(cluster.mlflow_run_id)
    assert r.info.status == "FINISHED"
    p = r.data.params
    assert p["main_fun"] == "mlflow_funs:train_epochs"
    assert (p["num_executors"], p["max_restarts"], p["input_mode"], p["gpus_per_node"]) == \
        ("2", "1", "TENSORFLOW", "0")
    assert p["tf_args.lr"] == "0.5" and p["tf_args.fail_once"] == "True"
    # the chief's epochs only (the worker's calls are no-ops), logged by the attempt
    # that succeeded (the chief failed before logging on the first)
    assert _history(client, r.info.run_id, "loss") == [(0, 1.0), (1, 0.5)]
    assert _history(client, r.info.run_id, "node") == [(0, 0.0), (1, 0.0)]
    # the restart: a metric and the cause, naming the failing node
    assert _history(client, r.info.run_id, "ember.restarts") == [(1, 1.0)]
    tags = r.data.tags
    assert "injected failure of the chief on attempt 0" in tags["ember.restart.1.message"]
    assert tags["ember.restart.1.node"] == "0" and tags["ember.job_id"] == cluster.job_id
    assert "ember.failure" not in tags and tags["ember.status"] == "FINISHED"
    # the exported model, as the chief wrote it
    assert [f.path for f in client.list_artifacts(r.info.run_id, "model")] == ["model/model.json"]
    local = client.download_artifacts(r.info.run_id, "model/model.json", str(tmp_path / "dl"))
    with open(local) as f:
        assert json.load(f) == {"weights": [1, 2, 3], "run_id": r.info.run_id}


def test_a_node_failure_ends_the_run_failed(local_spark, tracking, tmp_path):
    client = tracking
    cluster = run(local_spark.sparkContext, mlflow_funs.train_epochs,
                  {"out": str(tmp_path), "fail_always": True}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=60)
    with pytest.raises(EmberNodeError, match="injected failure of the chief, every attempt"):
        cluster.shutdown(timeout=60)
    r = client.get_run(cluster.mlflow_run_id)
    assert r.info.status == "FAILED"
    assert r.data.tags["ember.failure.node"] == "0"
    assert r.data.tags["ember.failure"].startswith("ember node 0 (chief:0") and \
        "failed with exit code 1" in r.data.tags["ember.failure"]
    assert "injected failure of the chief, every attempt" in r.data.tags["ember.failure.message"]


def test_estimator_fit_logs_params_epochs_and_the_exported_model(local_spark, tracking,
                                                                  tmp_path):
    import argparse

    from pyspark.ml.feature import SQLTransformer

    from examples.fashion_mnist import model as fm
    from ember.ml import EmberEstimator, EmberModel
    from ml_fashion import SCALE_SQL, fashion_frame

    client = tracking
    df = SQLTransformer(statement=SCALE_SQL).transform(
        fashion_frame(local_spark, "train", limit=640, parts=1))
    est = (EmberEstimator(fm.train_spark, argparse.Namespace(
               learning_rate=1e-3, intra_op_threads=1, inter_op_threads=1, steps_per_epoch=5))
           .setInputMapping({"image": "image", "label": "label"})
           .setOutputMapping({"classes": "class"}).setClusterSize(1).setEpochs(2)
           .setBatchSize(64).setReservationTimeout(120)
           .setModelDir(str(tmp_path / "model")).setExportDir(str(tmp_path / "export")))
    model = est.fit(df)
    assert isinstance(model, EmberModel)
    [r] = _runs(client)
    assert r.info.status == "FINISHED"
    p = r.data.params
    assert p["main_fun"] == "examples.fashion_mnist.model:train_spark"
    # the Params reach train_fn in tf_args, and so the run
    assert (p["tf_args.epochs"], p["tf_args.batch_size"], p["tf_args.cluster_size"],
            p["tf_args.steps_per_epoch"], p["tf_args.gpus_per_node"]) == ("2", "64", "1", "5", "0")
    assert r.data.tags["ember.estimator"] == est.uid
    # the chief's loss at the end of each of the 2 epochs
    loss = _history(client, r.info.run_id, "loss")
    assert [s for s, _ in loss] == [1, 2] and all(0 < v < 10 for _, v in loss), loss
    # ExportDir, the SavedModel the model serves, as the "model" artifact
    names = {f.path for f in client.list_artifacts(r.info.run_id, "model")}
    assert "model/saved_model.pb" in names and "model/variables" in names, names


def test_no_tracking_without_a_tracking_uri(local_spark, monkeypatch, tmp_path):
    """Without MLFLOW_TRACKING_URI nothing is tracked, ctx.log_metrics is a no-op,
    and importing Ember (driver and ML stages) does not import mlflow."""
    from ember import mlflow as ember_mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert not ember_mlflow.enabled() and ember_mlflow.JobRun.start("x") is None
    assert ember_mlflow.node_log_metrics({"a": 1.0}) is False
    cluster = run(local_spark.sparkContext, mlflow_funs.train_epochs, {"out": str(tmp_path)},
                  num_executors=2, input_mode=InputMode.TENSORFLOW, reservation_timeout=60)
    cluster.shutdown(timeout=60)
    assert cluster.mlflow_run_id is None
    assert os.path.exists(tmp_path / "export" / "model.json")
    code = ("import sys, ember.spark, ember.ml, ember.node, ember.mlflow, ember.yarn; "
            "assert 'mlflow' not in sys.modules, 'mlflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env=dict(os.environ, MLFLOW_TRACKING_URI="http://127.0.0.1:9"))


def test_run_on_yarn_failure_logging(tracking):
    """The client's logging of a failed and a succeeded attempt, from the
    objects run_on_yarn hands it (ember.yarn._tracking), read back."""
    from ember.yarn import NodeLabel, TaskSpec, _tracking
    from ember.yarn._specs import Metrics, RunFailed, TaskResult

    client = tracking
    specs = {"chief": TaskSpec("1 GiB", 2), "worker": TaskSpec(512, 1, instances=3,
                                                                 label=NodeLabel.GPU)}
    job = _tracking.start("yarn-test", specs, "default", 1, 600.0, None, None, "me")
    assert job is not None and job.node_env()["MLFLOW_RUN_ID"] == job.run_id
    _tracking.attempt_submitted(job, 1, "application_1_0001")
    _tracking.attempt_failed(job, 1, RunFailed(
        "attempt 1 (application_1_0001) ended FINISHED/FAILED: task worker:1 failed",
        "worker:1", ["application_1_0001"], "Traceback ...\nValueError: bad data",
        {"stderr": "ValueError: bad data\n", "stdout": "about to fail\n"}, []))
    _tracking.attempt_submitted(job, 2, "application_1_0002")
    _tracking.attempt_succeeded(job, 2, Metrics(
        {"chief:0": TaskResult("chief:0", 0, 12.5, {"loss": 0.25, "note": "x"},
                               "container_1_0002_01_000002", "host-a"),
         "worker:0": TaskResult("worker:0", 0, 11.0, None, "container_1_0002_01_000003",
                                "host-b")},
        ["application_1_0001", "application_1_0002"], 30.0, "http://host-a:6006"))
    job.end("FINISHED")
    r = client.get_run(job.run_id)
    assert r.info.status == "FINISHED"
    p = r.data.params
    assert (p["chief.memory_mb"], p["chief.vcores"], p["worker.instances"], p["worker.label"],
            p["nb_retries"]) == ("1024", "2", "3", "gpu", "1")
    t = r.data.tags
    assert t["yarn.app_id.1"] == "application_1_0001" and t["yarn.app_id"] == "application_1_0002"
    assert t["yarn.failure.1.task"] == "worker:1" and "task worker:1 failed" in t["yarn.failure.1"]
    assert (t["chief_0.host"], t["worker_0.container"], t["tensorboard_url"]) == \
        ("host-a", "container_1_0002_01_000003", "http://host-a:6006")
    m = r.data.metrics
    assert (m["chief_0.wall_s"], m["worker_0.wall_s"], m["chief_0.loss"]) == (12.5, 11.0, 0.25)
    assert "chief_0.note" not in m
    logs = {f.path for f in client.list_artifacts(r.info.run_id, "yarn_logs/attempt_1")}
    assert logs == {f"yarn_logs/attempt_1/worker_1_{n}.txt"
                    for n in ("traceback", "stderr", "stdout")}


def test_run_on_yarn_logs_the_chief_and_its_container(yarn, tracking):
    from ember.yarn import TaskSpec, run_on_yarn

    client = tracking
    m = run_on_yarn(mlflow_funs.yarn_epochs, {"chief": TaskSpec("512 MiB", 1)},
                    env={"PYTHONPATH": HERE}, name="ember-test-mlflow", timeout=300)
    [r] = _runs(client)
    assert r.info.status == "FINISHED" and r.info.run_name == "ember-test-mlflow"
    assert m["chief:0"].metrics["run_id"] == r.info.run_id  # the task got the run
    assert r.data.params["chief.instances"] == "1" and r.data.tags["yarn.app_id.1"] == m.app_id
    assert _history(client, r.info.run_id, "accuracy") == [(0, 0.5), (1, 0.6)]
    assert r.data.metrics["chief_0.final_accuracy"] == 0.6
    assert r.data.metrics["chief_0.wall_s"] > 0
    assert r.data.tags["chief_0.container"] == m["chief:0"].container
