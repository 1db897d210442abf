"""TensorFlowOnSpark 2.2.x's API on Ember: change the imports, keep the program.

    # before                                      # after
    from tensorflowonspark import TFCluster       from ember.compat.tfos import TFCluster
    from tensorflowonspark import TFNode          from ember.compat.tfos import TFNode
    from tensorflowonspark import dfutil          from ember.compat.tfos import dfutil

Modules: :mod:`TFCluster` (``run``, ``InputMode``), :mod:`TFNode` (``DataFeed``,
``hdfs_path``), :mod:`TFParallel`, :mod:`dfutil`, :mod:`compat`, :mod:`pipeline`.
Every difference in behaviour is listed in docs/moving-from-tensorflowonspark.md.
Importing this package does not import TensorFlow or pyspark; its modules do
when they need them.
"""

from __future__ import annotations

from typing import Any

from ember.spark import InputMode

__all__ = ["InputMode", "TFCluster", "TFNode", "TFParallel", "dfutil", "compat", "pipeline"]

_MODULES = ("TFCluster", "TFNode", "TFParallel", "dfutil", "compat", "pipeline")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
