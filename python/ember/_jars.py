"""Where the package's jars are: package data in ``ember/jars``, built with
the package (setup.py).  Importing this needs neither pyspark nor Hadoop."""

from __future__ import annotations

import os

JARS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jars")
SPARK_JAR = os.path.join(JARS_DIR, "ember-spark.jar")
YARN_AM_JAR = os.path.join(JARS_DIR, "ember-yarn-am.jar")
