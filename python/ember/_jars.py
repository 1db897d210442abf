"""Where the package's jars are: package data in ``ember/jars``, built with
the package (setup.py).  Importing this needs neither pyspark nor Hadoop, nor
the rest of Ember: setup.py loads this file on its own to name the Spark it
compiles the Spark jar against."""

from __future__ import annotations

import glob
import os
import re
import zipfile
from typing import Any, Dict, Optional, Tuple

JARS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jars")
SPARK_JAR = os.path.join(JARS_DIR, "ember-spark.jar")
YARN_AM_JAR = os.path.join(JARS_DIR, "ember-yarn-am.jar")

#: The manifest attributes of ember-spark.jar that name the Spark and Scala
#: versions of the jars it was compiled against (setup.py writes them).
SPARK_VERSION_ATTR = "Ember-Spark-Version"
SCALA_VERSION_ATTR = "Ember-Scala-Version"

_checked: Dict[str, bool] = {}  # jar path -> its Scala version matches the running Spark's


def classpath_versions(classpath: str) -> Tuple[Optional[str], Optional[str]]:
    """(Spark version, Scala version) of the jars on a javac class path
    (entries such as ``pyspark/jars/*`` or jar files), from the names of
    spark-core's and scala-library's jars; None for one not found."""
    spark = scala = None
    for entry in classpath.split(os.pathsep):
        for name in map(os.path.basename, glob.glob(entry)):
            core = re.fullmatch(r"spark-core_[\d.]+-(.+)\.jar", name)
            library = re.fullmatch(r"scala-library-(.+)\.jar", name)
            spark = core.group(1) if core else spark
            scala = library.group(1) if library else scala
    return spark, scala


def built_against(jar: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """(Spark version, Scala version) that ``jar`` (the Spark jar by default)
    was compiled against, from its manifest; None for what it does not say (a
    jar built before Ember recorded them, or no jar)."""
    try:
        with zipfile.ZipFile(jar or SPARK_JAR) as z:
            text = z.read("META-INF/MANIFEST.MF").decode("utf-8", "replace")
    except (OSError, KeyError, zipfile.BadZipFile):
        return None, None
    attrs = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return attrs.get(SPARK_VERSION_ATTR), attrs.get(SCALA_VERSION_ATTR)


def scala_binary(version: str) -> str:
    """The Scala binary version ("2.13") of a Scala version ("2.13.17"): the
    part that must match for compiled code to link."""
    return ".".join(version.split(".")[:2])


def check_spark_jar(sc: Any) -> None:
    """Raises :class:`ember.errors.SparkVersionError` when Ember's Spark jar was
    compiled against a Spark of another Scala binary version than the one
    ``sc`` runs (its classes would fail with NoSuchMethodError in the middle
    of a job).  Checked once per jar and process."""
    if _checked.get(SPARK_JAR) or not os.path.exists(SPARK_JAR):
        return
    spark, scala = built_against()
    running = str(sc._jvm.scala.util.Properties.versionNumberString())
    if scala is not None and scala_binary(scala) != scala_binary(running):
        from ember.errors import SparkVersionError

        raise SparkVersionError(
            f"Ember's Spark jar ({SPARK_JAR}) was compiled against Spark {spark} (Scala "
            f"{scala}), but this is Spark {sc.version} (Scala {running}): reinstall Ember "
            "from source where this Spark's pyspark is importable (or with SPARK_HOME set "
            "to this Spark), so that the jar is compiled against this Spark")
    _checked[SPARK_JAR] = True
