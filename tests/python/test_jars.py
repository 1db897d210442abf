"""ember._jars: the Spark and Scala versions the Spark jar was compiled
against, read from its manifest, and the refusal of a jar whose Scala
version is not the running Spark's (no JVM: a stand-in SparkContext)."""

from __future__ import annotations

import types
import zipfile

import pytest

from ember import _jars
from ember.errors import SparkVersionError


def _jar(path, attrs):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n" + "".join(
            f"{k}: {v}\n" for k, v in attrs.items()))
    return str(path)


def _context(spark, scala):
    props = types.SimpleNamespace(versionNumberString=lambda: scala)
    jvm = types.SimpleNamespace(scala=types.SimpleNamespace(util=types.SimpleNamespace(
        Properties=props)))
    return types.SimpleNamespace(version=spark, _jvm=jvm)


def test_versions_come_from_the_jar_names_on_the_classpath(tmp_path):
    for name in ("spark-core_2.12-3.5.9.jar", "scala-library-2.12.18.jar", "other-1.0.jar"):
        (tmp_path / name).write_bytes(b"")
    assert _jars.classpath_versions(str(tmp_path / "*")) == ("3.5.9", "2.12.18")
    assert _jars.classpath_versions(str(tmp_path / "other-1.0.jar")) == (None, None)


def test_a_jar_of_another_scala_version_is_refused_naming_both(tmp_path, monkeypatch):
    jar = _jar(tmp_path / "ember-spark.jar", {_jars.SPARK_VERSION_ATTR: "3.5.9",
                                              _jars.SCALA_VERSION_ATTR: "2.12.18"})
    monkeypatch.setattr(_jars, "SPARK_JAR", jar)
    monkeypatch.setattr(_jars, "_checked", {})
    assert _jars.built_against() == ("3.5.9", "2.12.18")
    with pytest.raises(SparkVersionError, match=r"compiled against Spark 3\.5\.9 \(Scala "
                       r"2\.12\.18\), but this is Spark 4\.1\.1 \(Scala 2\.13\.17\): "
                       r"reinstall Ember from source"):
        _jars.check_spark_jar(_context("4.1.1", "2.13.17"))
    _jars.check_spark_jar(_context("3.5.8", "2.12.17"))  # another patch release links


def test_a_jar_that_names_no_versions_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(_jars, "SPARK_JAR", _jar(tmp_path / "ember-spark.jar", {}))
    monkeypatch.setattr(_jars, "_checked", {})
    assert _jars.built_against() == (None, None)
    _jars.check_spark_jar(_context("4.1.1", "2.13.17"))
