"""Ember: distributed deep-learning training and inference on Spark, with a C engine.

Start with :func:`ember.spark.run` (also importable as ``ember.run``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from ember import _ember  # noqa: E402  (the C core; fails loudly if not built)

if _ember.__version__ != __version__:
    raise ImportError(f"ember {__version__} found its C extension at version "
                      f"{_ember.__version__}; rebuild it with `make build`")


def __getattr__(name: str) -> Any:
    # pyspark is imported only when the Spark API is used (not in node processes)
    if name in ("run", "InputMode", "Cluster", "EmberNodeError"):
        from ember import spark
        return getattr(spark, name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
