"""Hadoop YARN: ``run_on_yarn`` (tf-yarn's launcher: TensorFlow/PyTorch tasks
straight on YARN containers, without Spark), Spark-on-YARN settings, and an
environment check.

The 5-line versions::

    from ember.yarn import run_on_yarn, TaskSpec
    metrics = run_on_yarn(experiment_fn, {"chief": TaskSpec("2 GiB", 1),
                                          "worker": TaskSpec("2 GiB", 1, instances=2)})

    conf = ember.yarn.spark_conf(executors=2)     # dict of spark.* settings for --master yarn
    # from a shell:  python -m ember yarn check

:func:`run_on_yarn` (:mod:`ember.yarn._client`) stages the pickled
``experiment_fn`` on HDFS, submits Ember's ApplicationMaster
(``hadoop/yarn-app``) through the ResourceManager's REST API, and each
container runs :mod:`ember.yarn.task`, which joins the client's authenticated
rendezvous and runs the experiment (:mod:`ember.yarn.experiment`'s
``KerasExperiment`` / ``PytorchExperiment``, or a plain ``f(ctx)``).

Importing this package imports neither TensorFlow nor PyTorch: the experiment
kinds (``KerasExperiment``, ``PytorchExperiment``, ...) load
:mod:`ember.yarn.experiment` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ember.yarn._check import Step, check, spark_conf
from ember.yarn._client import run_on_yarn
from ember.yarn._specs import (Metrics, NodeLabel, RunFailed, TaskResult, TaskSpec,
                               ps_strategy_topology, single_server_topology)

# name -> submodule, loaded on first access (PEP 562) so that `import ember.yarn`
# stays light: the experiment module pulls in TensorFlow/PyTorch when used
_LAZY = {
    "KerasExperiment": "ember.yarn.experiment",
    "PytorchExperiment": "ember.yarn.experiment",
    "DataLoaderArgs": "ember.yarn.experiment",
    "DistributedDataParallelArgs": "ember.yarn.experiment",
}

__all__ = ["Step", "check", "spark_conf", "run_on_yarn", "TaskSpec", "NodeLabel",
           "single_server_topology", "ps_strategy_topology", "RunFailed", "Metrics",
           "TaskResult", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ember.yarn' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
