"""Spark's Python worker daemon, with what each worker it forks would do
first done once, before it forks.

Set ``spark.python.daemon.module=ember.spark_daemon`` and each executor
starts this module instead of ``pyspark.daemon``; everything else is Spark's
daemon, unchanged.  A worker's first task costs it about 0.5 CPU s before any
of the task's code runs (PySpark 4.3, Python 3.11); with this module, about
0.1:

- Spark's daemon imports its worker module after each fork: a worker module
  may start threads when imported (pandas and pyarrow do), and a fork keeps
  only the forking thread.  ``pyspark.worker`` starts none.  Imported here,
  it is imported once per executor instead of once per worker (about 0.3
  CPU s each).
- A worker's first task puts its Spark files' directory on ``sys.path`` and
  calls ``importlib.invalidate_caches()``.  Python (before 3.13) then has
  every zip importer re-read its whole archive: the one of ``pyspark.zip``
  and one for each package directory inside it that was imported from,
  18 reads of its 1,485 entries.  The package directories' importers are a
  cache (the import system makes one again, from the archive's directory
  already read, when it next needs one), so they are dropped here, and the
  call re-reads each archive once.
"""

import sys
import zipimport

import pyspark.worker  # noqa: F401  (imported once, before the workers are forked)
from pyspark.daemon import manager


def drop_package_zip_importers() -> None:
    """Drops the cached zip importers of directories inside archives."""
    for path, finder in list(sys.path_importer_cache.items()):
        if isinstance(finder, zipimport.zipimporter) and finder.prefix:
            del sys.path_importer_cache[path]


if __name__ == "__main__":
    drop_package_zip_importers()
    manager()
