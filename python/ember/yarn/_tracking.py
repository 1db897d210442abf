"""MLflow tracking of :func:`ember.yarn.run_on_yarn` (tf-yarn's ``client.py`` +
``metrics.py`` logging, through :mod:`ember.mlflow`).

One MLflow run per ``run_on_yarn`` call (every attempt logs into it): params
of the call and of each task spec (``<type>.instances``, ``.memory_mb``,
``.vcores``, ``.label``, ``.nb_proc_per_worker``); per attempt the
application id (tag ``yarn.app_id.<attempt>``); for a successful attempt,
per task its container time (metric ``<task>.wall_s``, tf-yarn's
``container_duration``), exit status, container and host (tags), and the
numbers of the dict the task returned (metrics ``<task>.<key>``), with
``<task>`` written ``chief_0`` as tf-yarn formats keys; for a failed attempt,
the failing task and the first line of the failure (tags) and the
traceback and container log tails (text artifacts
``yarn_logs/attempt_<n>/<task>_<file>``, as tf-yarn saves logs).  The tasks
get the run in their environment, so ``ctx.log_metrics`` of a chief logs into
it.  All of it is skipped when tracking is off (:func:`ember.mlflow.enabled`).
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Optional

from ember import mlflow as _mlflow
from ember.yarn._specs import Metrics, RunFailed, TaskSpec


def _task_key(task: str) -> str:
    """tf-yarn's ``format_key``: ``chief:0`` -> ``chief_0``."""
    return task.replace(":", "_").replace("/", "_")


def start(name: str, task_specs: Mapping[str, TaskSpec], queue: str, nb_retries: int,
          timeout: float, pyenv: Optional[str], custom_task_module: Optional[str],
          user: str) -> Optional[_mlflow.JobRun]:
    """The call's MLflow run (None when not tracked)."""
    params: Dict[str, Any] = dict(name=name, queue=queue, nb_retries=nb_retries,
                                  timeout=timeout, pyenv_zip_path=pyenv or "",
                                  custom_task_module=custom_task_module or "")
    for kind, spec in task_specs.items():
        params.update({f"{kind}.instances": spec.instances, f"{kind}.memory_mb": spec.memory_mb,
                       f"{kind}.vcores": spec.vcores, f"{kind}.label": spec.label.value,
                       f"{kind}.nb_proc_per_worker": spec.nb_proc_per_worker})
    return _mlflow.JobRun.start(name, params, {"ember.yarn.user": user,
                                               "ember.launcher": "run_on_yarn"})


def attempt_submitted(run: Optional[_mlflow.JobRun], attempt: int, app_id: str) -> None:
    if run is not None:
        run.set_tags({f"yarn.app_id.{attempt}": app_id})


def attempt_succeeded(run: Optional[_mlflow.JobRun], attempt: int, result: Metrics) -> None:
    """Per task: container time, exit status, container and host; the task's numbers."""
    if run is None:
        return
    metrics: Dict[str, float] = {"yarn.attempts": float(attempt)}
    tags: Dict[str, Any] = {"yarn.app_id": result.app_id}
    if result.tensorboard_url:
        tags["tensorboard_url"] = result.tensorboard_url
    for task, t in sorted(result.tasks.items()):
        key = _task_key(task)
        if t.wall_s is not None:
            metrics[f"{key}.wall_s"] = float(t.wall_s)
        for k, v in (t.metrics or {}).items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                metrics[f"{key}.{k}"] = float(v)
        tags.update({f"{key}.exit_status": t.exit_status, f"{key}.container": t.container or "",
                     f"{key}.host": t.host or ""})
    run.log_metrics(metrics, step=attempt)
    run.set_tags(tags)


def attempt_failed(run: Optional[_mlflow.JobRun], attempt: int, failure: RunFailed) -> None:
    """The failing task, the failure's first line, its traceback and log tails."""
    if run is None:
        return
    task = failure.task or "application"
    tags = _mlflow.failure_tags(f"yarn.failure.{attempt}", str(failure))
    tags[f"yarn.failure.{attempt}.task"] = task
    run.set_tags(tags)
    run.log_metrics({"yarn.failed_attempts": float(attempt)}, step=attempt)
    base = f"yarn_logs/attempt_{attempt}/{_task_key(task)}"
    if failure.traceback:
        run.log_text(failure.traceback, f"{base}_traceback.txt")
    for fname, text in sorted((failure.logs or {}).items()):
        run.log_text(text, f"{base}_{fname.replace('/', '_')}.txt")
