"""``ember version`` and ``ember doctor``: what this installation has, and what to fix.

Each check prints one line, ``ok``, ``warn`` or ``FAIL``, with the fix for
anything that is not ok; the exit status is 1 when a check failed.
Optional parts (TensorFlow, PyTorch, Hadoop) warn when missing; the parts
every Spark job needs (the C extension, Java, pyspark, the jars) fail.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import List, NamedTuple, Optional

OK, WARN, FAIL = "ok", "warn", "FAIL"


class Check(NamedTuple):
    status: str
    name: str
    detail: str
    fix: str = ""


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _try_import(module: str, timeout: float = 180.0) -> Optional[str]:
    """None when ``module`` imports in a fresh interpreter, else the last
    line of its error (a broken install often shows only at import)."""
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode == 0:
        return None
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit status {r.returncode}"


def check_extension() -> Check:
    try:
        from ember import _ember
    except ImportError as e:
        return Check(FAIL, "C extension", str(e), "reinstall Ember (pip install ember / "
                     "`make build` in a checkout); it needs libcrypto, zlib, libcurl and "
                     "MIT Kerberos (libgssapi_krb5)")
    return Check(OK, "C extension", f"{_ember.__version__}, built by {_ember.COMPILER}, "
                 f"{_ember.__file__}")


def _java_major(text: str) -> Optional[int]:
    m = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major


def check_java() -> Check:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on PATH"
        return Check(FAIL, "Java", where,
                     "install a JDK 17 or 21 (Debian: apt-get install openjdk-17-jdk-headless)")
    r = subprocess.run([java, "-version"], capture_output=True, text=True)
    major = _java_major(r.stderr + r.stdout)
    if major is None or major < 17:
        return Check(FAIL, "Java", f"{java}: version {major or 'unknown'}",
                     "Spark 4 needs Java 17 or 21: set JAVA_HOME to one")
    return Check(OK, "Java", f"{major} ({java})")


def check_spark() -> Check:
    version = _dist_version("pyspark")
    if version is None:
        home = os.environ.get("SPARK_HOME")
        if home:
            return Check(WARN, "Spark", f"SPARK_HOME={home}, pyspark not installed in this "
                         "Python", "pip install 'ember[spark]' or add $SPARK_HOME/python "
                         "to PYTHONPATH")
        return Check(FAIL, "Spark", "pyspark is not installed", "pip install 'ember[spark]'")
    from ember._spark_compat import OLDEST

    if tuple(int(x) for x in version.split(".")[:2]) < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        return Check(FAIL, "Spark", f"pyspark {version}", f"Ember needs Spark {oldest} or "
                     f"later: pip install 'pyspark>={oldest}'")
    return Check(OK, "Spark", f"pyspark {version}")


def check_jars() -> List[Check]:
    from ember import _jars

    out = []
    for name, jar, without in [("Spark jar", _jars.SPARK_JAR, "EmberModel uses the slower "
                                "Arrow path"),
                               ("YARN ApplicationMaster jar", _jars.YARN_AM_JAR,
                                "run_on_yarn needs EMBER_YARN_AM_JAR")]:
        out.append(Check(OK, name, jar) if os.path.isfile(jar) else
                   Check(WARN, name, f"missing ({jar}): {without}",
                         "reinstall Ember from a wheel (it carries the jars)"))
    out[0] = _spark_jar_versions(out[0])
    return out


def _spark_jar_versions(check: Check) -> Check:
    """The Spark jar's check, with the Spark and Scala versions the jar was
    compiled against; a failure when this Python's pyspark has another Scala
    version (the jar's classes would not link)."""
    from ember import _jars

    spark, scala = _jars.built_against()
    if scala is None:
        return check
    detail = f"{check.detail} (Spark {spark}, Scala {scala})"
    spec = importlib.util.find_spec("pyspark")
    here_spark, here_scala = _jars.classpath_versions(
        os.path.join(os.path.dirname(spec.origin), "jars", "*")) \
        if spec is not None and spec.origin else (None, None)
    if here_scala is None or _jars.scala_binary(here_scala) == _jars.scala_binary(scala):
        return check._replace(detail=detail)
    return Check(FAIL, check.name, f"{detail}, but pyspark {here_spark} is Scala {here_scala}",
                 "reinstall Ember from source in this Python, so that its Spark jar is "
                 "compiled against this pyspark")


def check_framework(dist_names: List[str], module: str, label: str, extra: str) -> Check:
    version = next((v for v in map(_dist_version, dist_names) if v), None)
    if version is None:
        try:
            version = getattr(__import__(module), "__version__", "?")  # e.g. Debian's torch
        except ImportError:
            return Check(WARN, label, "not installed (needed only for its models)",
                         f"pip install 'ember[{extra}]'")
    err = _try_import(module)
    if err:
        return Check(FAIL, label, f"{version} is installed but does not import: {err}",
                     f"reinstall it: pip install --force-reinstall 'ember[{extra}]'")
    return Check(OK, label, version)


def check_hadoop() -> Check:
    from ember import hdfs

    conf = os.environ.get("HADOOP_CONF_DIR")
    if not conf:
        return Check(WARN, "Hadoop", "HADOOP_CONF_DIR is not set (needed for hdfs:// and "
                     "YARN only)", "export HADOOP_CONF_DIR=/etc/hadoop/conf (the directory "
                     "with core-site.xml); then `ember yarn check`")
    missing = [f for f in ("core-site.xml", "hdfs-site.xml", "yarn-site.xml")
               if not os.path.isfile(os.path.join(conf, f))]
    if missing:
        return Check(WARN, "Hadoop", f"HADOOP_CONF_DIR={conf} lacks {', '.join(missing)}",
                     "point HADOOP_CONF_DIR at the cluster's client configuration")
    where = f"HADOOP_CONF_DIR={conf}, fs.defaultFS={hdfs.default_fs(conf)}"
    core = hdfs._conf_props(os.path.join(conf, "core-site.xml"))
    if core.get("hadoop.security.authentication", "simple").lower() == "kerberos":
        from ember import _ember

        tokens = os.environ.get("HADOOP_TOKEN_FILE_LOCATION")
        principal = _ember.kerberos_principal()
        if principal:
            where += f", Kerberos as {principal}"
        elif tokens:
            where += f", Kerberos through the delegation tokens in {tokens}"
        else:
            return Check(WARN, "Hadoop", f"{where}: the grid is Kerberized and this process "
                         "has no Kerberos ticket, keytab or delegation token",
                         "kinit <you>@<REALM> (or kinit -kt <keytab> <principal>, or "
                         "KRB5_CLIENT_KTNAME=<keytab>)")
    return Check(OK, "Hadoop", where + " (`ember yarn check` tests the cluster itself)")


def run_checks() -> List[Check]:
    checks = [Check(OK, "Python", sys.version.split()[0] + f" ({sys.executable})"),
              check_extension()]
    if checks[-1].status == OK:
        checks.extend(check_jars())
    checks += [check_java(), check_spark(),
               check_framework(["tensorflow", "tensorflow-cpu"], "tensorflow", "TensorFlow",
                               "tensorflow"),
               check_framework(["torch"], "torch", "PyTorch", "torch"),
               check_hadoop()]
    return checks


def doctor_main(args: object = None) -> int:
    from ember._version import __version__

    print(f"ember {__version__}")
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            print(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        print(f"{len(failed)} check(s) failed: {', '.join(failed)}")
    return 1 if failed else 0


def version_main(args: object = None) -> int:
    from ember._version import __version__

    print(f"ember {__version__}")
    return 0
