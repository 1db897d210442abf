"""Hadoop YARN: Spark-on-YARN settings, an environment check, and
``run_on_yarn`` (tf-yarn's launcher: TensorFlow/PyTorch tasks straight on
YARN containers, without Spark).

The 5-line versions::

    from ember import yarn
    conf = yarn.spark_conf(executors=2)           # dict of spark.* settings
    spark = SparkSession.builder.master("yarn").config(map=conf).getOrCreate()
    # or, from a shell:  python -m ember yarn check

Importing this package imports neither TensorFlow nor PyTorch: the experiment
kinds (``KerasExperiment``, ``PytorchExperiment``, ...) load
:mod:`ember.yarn.experiment` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ember.yarn._check import Step, check, check_main, spark_conf
from ember.yarn._client import (Metrics, NodeLabel, RunFailed, TaskResult, TaskSpec,
                                ps_strategy_topology, run_on_yarn, single_server_topology)

# name -> submodule, loaded on first access (PEP 562) so that `import ember.yarn`
# stays light: the experiment module pulls in TensorFlow/PyTorch when used
_LAZY = {
    "KerasExperiment": "ember.yarn.experiment",
    "PytorchExperiment": "ember.yarn.experiment",
    "DataLoaderArgs": "ember.yarn.experiment",
    "DistributedDataParallelArgs": "ember.yarn.experiment",
}

__all__ = ["Step", "check", "check_main", "spark_conf", "run_on_yarn", "TaskSpec", "NodeLabel",
           "single_server_topology", "ps_strategy_topology", "RunFailed", "Metrics",
           "TaskResult", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ember.yarn' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
