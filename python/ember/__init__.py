"""Ember: distributed deep-learning training and inference on Spark, with a C engine.

Start with :func:`ember.spark.run` (also importable as ``ember.run``).
"""

from __future__ import annotations

from typing import Any

from ember._version import __version__  # noqa: F401

# the C core; it refuses to load beside a package of another version
from ember import _ember  # noqa: E402, F401
from ember.errors import EmberError, EmberFeedError  # noqa: E402, F401


def __getattr__(name: str) -> Any:
    # pyspark is imported only when the Spark API is used (not in node processes)
    if name in ("run", "InputMode", "Cluster", "EmberNodeError"):
        from ember import spark
        return getattr(spark, name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
