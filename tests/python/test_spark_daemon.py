"""ember.spark_daemon: Spark's worker daemon with pyspark.worker imported
and the package zip importers dropped before it forks its workers."""

from __future__ import annotations

import importlib
import sys
import zipfile
import zipimport

from ember import spark_daemon


def _daemon_of_this_worker(_: object) -> object:
    import sys

    main = sys.modules["__main__"]
    yield (main.__spec__.name if main.__spec__ else None, "pyspark.worker" in sys.modules)


def test_the_tests_spark_forks_its_workers_from_ember_spark_daemon(local_spark):
    # conftest's JAVA_TOOL_OPTIONS carry spark.python.daemon.module (jvm_archive.py)
    assert local_spark.sparkContext.getConf().get("spark.python.daemon.module") == \
        "ember.spark_daemon"
    seen = set(local_spark.sparkContext.parallelize(range(4), 4)
               .mapPartitions(_daemon_of_this_worker).collect())
    assert seen == {("ember.spark_daemon", True)}


def test_package_zip_importers_are_dropped_and_imports_still_work(tmp_path, monkeypatch):
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zpkg/__init__.py", "")
        z.writestr("zpkg/sub/__init__.py", "")
        z.writestr("zpkg/sub/a.py", "VALUE = 'a'")
        z.writestr("zpkg/sub/b.py", "VALUE = 'b'")
    monkeypatch.syspath_prepend(str(archive))
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    try:
        assert importlib.import_module("zpkg.sub.a").VALUE == "a"
        in_archive = {p: f for p, f in sys.path_importer_cache.items()
                      if isinstance(f, zipimport.zipimporter) and f.archive == str(archive)}
        assert {f.prefix for f in in_archive.values()} == {"", "zpkg/", "zpkg/sub/"}

        spark_daemon.drop_package_zip_importers()
        left = [f for f in sys.path_importer_cache.values()
                if isinstance(f, zipimport.zipimporter) and f.archive == str(archive)]
        assert [f.prefix for f in left] == [""]
        importlib.invalidate_caches()  # what a worker's first task does
        assert importlib.import_module("zpkg.sub.b").VALUE == "b"
    finally:
        for name in [m for m in sys.modules if m == "zpkg" or m.startswith("zpkg.")]:
            del sys.modules[name]
