"""MLflow tracking of Ember jobs (what tf-yarn's ``tf_yarn.mlflow`` does for tf-yarn).

The 5-line version::

    export MLFLOW_TRACKING_URI=http://mlflow.example:5000     # that is all it takes
    cluster = run(sc, main_fun, args, num_executors=2)        # one MLflow run per job

    def main_fun(args, ctx):
        ...
        ctx.log_metrics({"loss": loss, "accuracy": acc}, step=epoch)   # the chief's
        ctx.log_artifacts(export_dir, "model")                           # the chief's

With ``MLFLOW_TRACKING_URI`` set (and ``mlflow`` installed), :func:`ember.spark.run`
opens one MLflow run for the job, in the experiment of ``MLFLOW_EXPERIMENT_NAME``
(or ``MLFLOW_EXPERIMENT_ID``; default: MLflow's default experiment), or logs
into the driver's active run (``mlflow.start_run()``, or ``MLFLOW_RUN_ID``).
It logs the job's parameters: ``run``'s arguments, and ``tf_args`` under
``tf_args.<name>``; node failures and restarts (metric ``ember.restarts``,
tags ``ember.restart.<n>`` and ``ember.failure``); and ends the run FINISHED at a
clean ``shutdown()``, FAILED when a node failure is raised.  Every node gets the
run's id (``EMBER_MLFLOW_RUN_ID`` and ``MLFLOW_RUN_ID``, with
``MLFLOW_TRACKING_URI``): ``ctx.log_metrics`` and ``ctx.log_artifacts`` log
through MLflow's client from the chief (worker 0 without a chief), and do
nothing on other nodes or without tracking.  :class:`ember.ml.EmberEstimator`'s
``fit`` logs the same plus its ExportDir as the ``model`` artifact;
:func:`ember.yarn.run_on_yarn` logs as tf-yarn does (task specs, per-task
container times, hosts and log tails of failed tasks).

Tracking never fails a job: an MLflow error is printed and the job goes on.
``mlflow`` is imported only when tracking is on; ``EMBER_MLFLOW=0`` turns it
off with ``MLFLOW_TRACKING_URI`` set.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Dict, Iterable, Mapping, Optional

#: the job's MLflow run id in every node's environment
RUN_ID_ENV = "EMBER_MLFLOW_RUN_ID"

_PARAM_MAX = 6000  # MLflow's limit on a param value
_TAG_MAX = 8000  # ... and on a tag value
_BATCH = 100  # params or tags per log_batch call


logger = logging.getLogger("ember.mlflow")


def enabled() -> bool:
    """Whether jobs are tracked: ``MLFLOW_TRACKING_URI`` is set, ``EMBER_MLFLOW``
    is not ``0``/``false``, and ``mlflow`` imports."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return False
    if os.environ.get("EMBER_MLFLOW", "").lower() in ("0", "false", "no"):
        return False
    try:
        import mlflow  # noqa: F401
    except ImportError:
        logger.warning("MLFLOW_TRACKING_URI is set but mlflow is not installed: not "
                       "tracking (pip install mlflow, or unset MLFLOW_TRACKING_URI)")
        return False
    return True


def _key(name: str) -> str:
    """A name MLflow takes as a param/metric/tag key (alphanumerics, ``_-./ ``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", str(name))[:250] or "_"


def _text(value: Any, limit: int) -> str:
    s = str(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def args_params(args: Any, prefix: str = "tf_args.") -> Dict[str, str]:
    """``tf_args`` (a dict, an argparse.Namespace or any object with ``vars``) as
    params named ``<prefix><name>``; another value is one param ``tf_args``."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        items: Iterable[Any] = args.items()
    elif hasattr(args, "__dict__"):
        items = vars(args).items()
    else:
        return {prefix.rstrip("."): _text(args, _PARAM_MAX)}
    return {_key(prefix + str(k)): _text(v, _PARAM_MAX) for k, v in items
            if not str(k).startswith("_")}


def _safe(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - tracking must never fail the job
        logger.warning(f"{what} failed (the job goes on; check the tracking server): "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None


class JobRun:
    """The MLflow run of one job, on the driver (or the run_on_yarn client).

    Made by :meth:`start`; every method logs through ``MlflowClient`` and
    turns an MLflow error into a printed warning.  Thread-safe as MLflow's
    client is (calls are independent HTTP requests)."""

    def __init__(self, client: Any, run_id: str, tracking_uri: str, owned: bool) -> None:
        self.client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.owned = owned  #: False when logging into the caller's active run (not ended here)
        self.ended = False

    @classmethod
    def start(cls, name: str, params: Optional[Mapping[str, Any]] = None,
              tags: Optional[Mapping[str, Any]] = None) -> Optional["JobRun"]:
        """The job's run, or None when tracking is off (see :func:`enabled`) or
        the tracking server cannot be reached.  Logs into the caller's active
        run (``mlflow.start_run()`` in this process, or ``MLFLOW_RUN_ID``) when
        there is one, else creates a run named ``name``."""
        if not enabled():
            return None
        return _safe("starting the MLflow run", cls._start, name, params or {}, tags or {})

    @classmethod
    def _start(cls, name: str, params: Mapping[str, Any], tags: Mapping[str, Any]) -> "JobRun":
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = mlflow.get_tracking_uri()
        client = MlflowClient(uri)
        active = mlflow.active_run()
        run_id = active.info.run_id if active is not None else os.environ.get("MLFLOW_RUN_ID")
        owned = not run_id
        if owned:
            run_id = client.create_run(_experiment_id(client), run_name=name,
                                       tags={k: _text(v, _TAG_MAX) for k, v in tags.items()}
                                       ).info.run_id
        job = cls(client, str(run_id), uri, owned)
        if not owned:
            job.set_tags(tags)
        job.log_params(params)
        logger.info(f"tracking {name} in MLflow run {run_id} at {uri}")
        return job

    def node_env(self) -> Dict[str, str]:
        """What nodes need to log into this run (tf-yarn passes the same)."""
        return {"MLFLOW_TRACKING_URI": self.tracking_uri, "MLFLOW_RUN_ID": self.run_id,
                RUN_ID_ENV: self.run_id, "GIT_PYTHON_REFRESH": "quiet"}

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Logs params (values cut to MLflow's 6000 characters)."""
        from mlflow.entities import Param

        items = [Param(_key(k), _text(v, _PARAM_MAX)) for k, v in params.items()]
        for i in range(0, len(items), _BATCH):
            _safe("logging params", self.client.log_batch, self.run_id,
                  params=items[i:i + _BATCH])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(_key(k), _text(v, _TAG_MAX)) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH):
            _safe("setting tags", self.client.log_batch, self.run_id, tags=items[i:i + _BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        _log_metrics(self.client, self.run_id, metrics, step)

    def log_artifacts(self, local_dir: str, artifact_path: Optional[str] = None) -> None:
        """Uploads a directory (its files under ``artifact_path``)."""
        path = local_dir[len("file://"):] if local_dir.startswith("file://") else local_dir
        if "://" in path:
            logger.warning(f"not logging {local_dir} as an artifact: only local directories "
                           "are (copy it to the driver first)")
            return
        _safe(f"logging {local_dir} as an artifact", self.client.log_artifacts, self.run_id,
              path, artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        _safe(f"logging {artifact_file}", self.client.log_text, self.run_id, text,
              artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        """Ends the run (``FINISHED``, ``FAILED`` or ``KILLED``) if this job made
        it; a caller's active run is left to its owner.  Idempotent."""
        if self.ended:
            return
        self.ended = True
        self.set_tags({"ember.status": status})
        if self.owned:
            _safe("ending the MLflow run", self.client.set_terminated, self.run_id, status)


def _experiment_id(client: Any) -> str:
    exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if exp_id:
        return exp_id
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"  # MLflow's default experiment
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else client.create_experiment(name)


def _log_metrics(client: Any, run_id: str, metrics: Mapping[str, float],
                 step: Optional[int]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(_key(k), float(v), now, int(step or 0)) for k, v in metrics.items()]
    for i in range(0, len(items), 1000):
        _safe("logging metrics", client.log_batch, run_id, metrics=items[i:i + 1000])


# --------------------------------------------------------------------------- nodes

class _NodeRun:
    """A node's handle on its job's run, from its environment."""

    def __init__(self, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


_node_run: Optional[_NodeRun] = None


def node_run_id() -> Optional[str]:
    """The job's MLflow run id in a node (None when the job is not tracked)."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return os.environ.get(RUN_ID_ENV) or None


def _node() -> Optional[_NodeRun]:
    global _node_run
    run_id = node_run_id()
    if run_id is None:
        return None
    if _node_run is None or _node_run.run_id != run_id:
        try:
            _node_run = _NodeRun(run_id)
        except ImportError:
            logger.warning("the job is tracked but mlflow is not installed on this node: not "
                           "logging (install mlflow in the nodes' Python environment)")
            return None
    return _node_run


def node_log_metrics(metrics: Mapping[str, float], step: Optional[int] = None) -> bool:
    """Logs metrics into the job's run from a node; False when not tracked."""
    node = _node()
    if node is None:
        return False
    _log_metrics(node.client, node.run_id, metrics, step)
    return True


def node_log_artifacts(local_path: str, artifact_path: Optional[str] = None) -> bool:
    """Uploads a node's local file or directory into the job's run; False when
    not tracked."""
    node = _node()
    if node is None:
        return False
    path = local_path[len("file://"):] if local_path.startswith("file://") else local_path
    fn = node.client.log_artifacts if os.path.isdir(path) else node.client.log_artifact
    _safe(f"logging {local_path} as an artifact", fn, node.run_id, path, artifact_path)
    return True


def failure_tags(prefix: str, message: str) -> Dict[str, str]:
    """Tags for a failure: its first line under ``prefix`` and the whole
    message (cut to MLflow's limit) under ``prefix.message``."""
    lines = message.strip().splitlines() or [""]
    return {prefix: _text(lines[0], _TAG_MAX), prefix + ".message": _text(message, _TAG_MAX)}
