"""Build steps that pyproject.toml cannot declare: the C extension and the jars.

The extension ``ember._ember`` is compiled from the C engine's sources
(csrc/*.c) and the binding (python/ember/_ember*.c) with the project's
warning flags, and links OpenSSL's libcrypto, zlib, libcurl and MIT Kerberos's
GSS-API (SPNEGO for Kerberized Hadoop).

The package carries two jars as package data in ``ember/jars``:

- ``ember-spark.jar``, EmberModel's direct inference path (spark/src), compiled
  with javac against Spark's jars: those of ``$SPARK_HOME`` or of an importable
  pyspark (``make`` builds in the project's venv), otherwise the jars Maven
  resolves from spark/pom.xml (an isolated ``pip install .``).  spark/src
  compiles against Spark 3.5 (Scala 2.12) and 4 (Scala 2.13), with the
  ``spark/src-scala-<2.12|2.13>`` directory of the jars' Scala version; the
  classes link only against that Scala version, so the manifest names the
  Spark and Scala versions (ember._jars), Ember checks the Scala version where
  it loads the jar, and a build that sees a Spark of another Scala version
  than the jar's compiles it again;
- ``ember-yarn-am.jar``, run_on_yarn's ApplicationMaster (hadoop/yarn-app), built
  by Maven.

A jar that is already there and newer than its sources is kept (the Spark
jar: unless the build sees a Spark of another Scala version), so an sdist
(which includes the built jars) builds with a C compiler alone.  The same
holds for the extension: one built in place (``python/ember/_ember*.so``, what
an editable install leaves) that is newer than its sources and this file is
copied, not compiled again (``make setup`` installs the package editable in
two venvs of the same Python).  Otherwise the sources compile in parallel,
one per CPU (``EMBER_BUILD_JOBS`` sets how many).

A second, optional extension, ``ember._ember_tf``, holds the TensorFlow ops
behind ``ember.tf.feed_dataset`` and ``ember.tf.allreduce``
(python/ember/_tf_feed_op.c, _tf_allreduce_op.c, in C against TensorFlow's C
kernel API).  It is built only when TensorFlow is installed
where the build runs (found without importing it: see ``_tensorflow_dir``),
since it links TensorFlow's libtensorflow_framework.so.2.  It is a plain
shared library that ``tf.load_op_library`` loads, never a Python module to
import; it is not linked with libember (it reaches the feed through the
function tables ember._ember hands out, ember/feed_reader.h and
collective.h).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
JARS = os.path.join(ROOT, "python", "ember", "jars")


def _load_jars_module() -> Any:
    """ember/_jars.py on its own (the package cannot be imported before its
    extension is built): the Spark jar's manifest attributes and readers."""
    spec = importlib.util.spec_from_file_location(
        "_ember_build_jars", os.path.join(ROOT, "python", "ember", "_jars.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_jars = _load_jars_module()


def _version() -> str:
    scope: dict = {}
    with open(os.path.join(ROOT, "python", "ember", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _rel(*patterns: str) -> List[str]:
    return sorted(os.path.relpath(p, ROOT) for pat in patterns
                  for p in glob.glob(os.path.join(ROOT, pat)))


def _newer_than(target: str, sources: List[str]) -> bool:
    if not os.path.exists(target):
        return False
    t = os.path.getmtime(target)
    return all(os.path.getmtime(os.path.join(ROOT, s)) <= t for s in sources)


def _run(cmd: List[str], what: str, cwd: Optional[str] = None) -> None:
    print(f"ember: {what}: {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, check=True, cwd=cwd)
    except FileNotFoundError:
        sys.exit(f"ember: {what} needs {cmd[0]!r}, which is not installed "
                 "(Debian: apt-get install openjdk-17-jdk-headless maven)")
    except subprocess.CalledProcessError as e:
        sys.exit(f"ember: {what} failed (exit status {e.returncode}): {' '.join(cmd)}")


def _maven(pom: str, goals: List[str], props: List[str]) -> None:
    repo = os.environ.get("EMBER_M2_REPO")
    base = [os.environ.get("MVN", "mvn"), "-B", "-q", "-f", pom, f"-Drevision={_version()}"]
    if repo:
        base.append(f"-Dmaven.repo.local={os.path.abspath(repo)}")
    # offline first: a filled local repository needs no network
    cmd = base + props + goals
    if subprocess.run(cmd + ["-o"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        _run(cmd, f"maven {os.path.relpath(pom, ROOT)}")


def _local_spark_classpath() -> Optional[str]:
    """The jars of the Spark the package will run in, when the build can see
    it: ``$SPARK_HOME``'s or an importable pyspark's; else None."""
    home = os.environ.get("SPARK_HOME")
    if home and os.path.isdir(os.path.join(home, "jars")):
        return os.path.join(home, "jars", "*")
    try:
        import pyspark
        return os.path.join(os.path.dirname(pyspark.__file__), "jars", "*")
    except ImportError:
        return None


def _spark_classpath(tmp: str) -> str:
    local = _local_spark_classpath()
    if local is not None:
        return local
    out = os.path.join(tmp, "classpath.txt")
    _maven(os.path.join(ROOT, "spark", "pom.xml"), ["dependency:build-classpath"],
           [f"-Dmdep.outputFile={out}"])
    with open(out) as f:
        return f.read().strip()


def _other_scala(jar: str) -> bool:
    """Whether the Spark this build sees has another Scala version than the
    one ``jar`` was compiled against (False when either is unknown)."""
    local = _local_spark_classpath()
    built = _jars.built_against(jar)[1]
    seen = _jars.classpath_versions(local)[1] if local is not None else None
    return built is not None and seen is not None and \
        _jars.scala_binary(built) != _jars.scala_binary(seen)


def build_spark_jar() -> None:
    common = _rel("spark/src/ember/spark/*.java")
    every = common + _rel("spark/src-scala-*/ember/spark/*.java")
    target = _jars.SPARK_JAR
    if not common or (_newer_than(target, every) and not _other_scala(target)):
        return
    with tempfile.TemporaryDirectory() as tmp:
        classes = os.path.join(tmp, "classes")
        classpath = _spark_classpath(tmp)
        spark, scala = _jars.classpath_versions(classpath)
        versioned = _rel(f"spark/src-scala-{_jars.scala_binary(scala or '?')}/ember/spark/*.java")
        if not versioned:
            sys.exit(f"ember: compiling ember-spark.jar: Ember has no sources for Scala {scala} "
                     f"(Spark {spark}; the jars on {classpath}): it runs on Spark 3.5 with "
                     "Scala 2.12 and Spark 4 with Scala 2.13")
        _run(["javac", "--release", "17", "-Xlint:all,-path,-serial,-classfile", "-Werror",
              "-d", classes, "-cp", classpath] + common + versioned,
             f"compiling ember-spark.jar against Spark {spark} (Scala {scala})", cwd=ROOT)
        manifest = os.path.join(tmp, "MANIFEST.MF")
        with open(manifest, "w") as f:
            for attr, value in ((_jars.SPARK_VERSION_ATTR, spark),
                                (_jars.SCALA_VERSION_ATTR, scala)):
                if value is not None:
                    f.write(f"{attr}: {value}\n")
        os.makedirs(JARS, exist_ok=True)
        _run(["jar", "cfm", target, manifest, "-C", classes, "ember"], "packing ember-spark.jar")


def build_yarn_am_jar() -> None:
    sources = _rel("hadoop/yarn-app/pom.xml", "hadoop/yarn-app/src/main/*/*",
                   "hadoop/yarn-app/src/main/java/org/ember/yarn/*.java")
    target = os.path.join(JARS, "ember-yarn-am.jar")
    if not sources or _newer_than(target, sources):
        return
    with tempfile.TemporaryDirectory() as tmp:
        _maven(os.path.join(ROOT, "hadoop", "yarn-app", "pom.xml"), ["package"],
               [f"-Dember.out={tmp}"])
        os.makedirs(JARS, exist_ok=True)
        shutil.copyfile(os.path.join(tmp, "ember-yarn-am.jar"), target)


class BuildPyWithJars(build_py):
    """build_py, after building the jars it ships as package data."""

    def run(self) -> None:
        if os.environ.get("EMBER_SKIP_JARS") != "1":
            build_spark_jar()
            build_yarn_am_jar()
        super().run()


class BuildExt(build_ext):
    """build_ext that reuses an up-to-date extension built in place and
    otherwise compiles the sources in parallel."""

    def run(self) -> None:
        if TF_DIR is None:
            print("TensorFlow not found in this environment: ember.tf.feed_dataset's op is "
                  "not built; pip install tensorflow, then reinstall ember", flush=True)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        built = os.path.join(ROOT, "python", *ext.name.split(".")) + \
            (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        target = self.get_ext_fullpath(ext.name)
        inputs = list(ext.sources) + list(ext.depends) + [os.path.basename(__file__)]
        if os.path.abspath(built) != os.path.abspath(target) and os.path.exists(built) \
                and _newer_than(built, inputs):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(built, target)
            print(f"reusing {os.path.relpath(built, ROOT)} (newer than its sources)")
            return
        jobs = int(os.environ.get("EMBER_BUILD_JOBS") or os.cpu_count() or 1)
        serial = self.compiler.compile

        def compile_parallel(sources: List[str], *args: Any, **kwargs: Any) -> List[str]:
            if jobs < 2 or len(sources) < 2:
                return serial(sources, *args, **kwargs)
            with ThreadPoolExecutor(jobs) as pool:
                objects = pool.map(lambda src: serial([src], *args, **kwargs), sources)
                return [obj for one in objects for obj in one]

        self.compiler.compile = compile_parallel  # type: ignore[method-assign]
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = serial  # type: ignore[method-assign]


WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wstrict-prototypes",
            "-Wno-unused-parameter"]

extension = Extension(
    "ember._ember",
    sources=_rel("csrc/*.c", "python/ember/_ember*.c"),
    include_dirs=["csrc/include", "csrc"],
    define_macros=[("_GNU_SOURCE", None), ("EMBER_VERSION", f'"{_version()}"')],
    # -UNDEBUG: the engine keeps its assertions, as in the Makefile's build
    extra_compile_args=["-std=c11", "-pthread", "-fvisibility=hidden", "-UNDEBUG", "-O2"]
    + WARNINGS,
    extra_link_args=["-pthread"],
    libraries=["crypto", "z", "curl", "gssapi_krb5", "krb5", "m"],
    depends=_rel("csrc/include/ember/*.h", "csrc/*.h", "python/ember/_ember*.h"),
)


def _tensorflow_dir() -> Optional[str]:
    """TensorFlow's package directory, when TensorFlow is installed where this
    build runs and ships the C kernel API's header and library; else None.

    Found with find_spec, not imported: an import takes seconds, and the
    build only needs the files.  An isolated build (``python -m build``,
    ``pip install .`` without --no-build-isolation) has no TensorFlow, so its
    wheel has no op; neither does the PyTorch venv's install."""
    try:
        spec = importlib.util.find_spec("tensorflow")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    tf = locations[0]
    needed = [os.path.join(tf, "include", "tensorflow", "c", "kernels.h"),
              os.path.join(tf, "libtensorflow_framework.so.2")]
    return tf if all(os.path.exists(p) for p in needed) else None


TF_DIR = _tensorflow_dir()
extensions = [extension]
if TF_DIR is not None:
    extensions.append(Extension(
        "ember._ember_tf",
        sources=["python/ember/_tf_feed_op.c", "python/ember/_tf_allreduce_op.c",
                 "python/ember/_tf_kernel.c"],
        include_dirs=["csrc/include"],
        define_macros=[("_GNU_SOURCE", None)],
        # -isystem: TensorFlow's headers are not held to the project's -Werror
        # (ops.h alone fails -Wstrict-prototypes).  C headers only, so no
        # EIGEN_MAX_ALIGN_BYTES: that matters to C++ ops sharing Eigen types.
        extra_compile_args=["-std=c11", "-pthread", "-fvisibility=hidden", "-O2"] + WARNINGS
        + ["-isystem", os.path.join(TF_DIR, "include")],
        # -z defs: a TF_ symbol the framework library lacks fails this link
        # instead of tf.load_op_library at run time.  The rpath finds the
        # framework when the library is loaded on its own (nm, ldd); under
        # TensorFlow it is loaded already, by soname.
        extra_link_args=["-pthread", f"-L{TF_DIR}", "-l:libtensorflow_framework.so.2",
                         f"-Wl,-rpath,{TF_DIR}", "-Wl,-z,defs"],
        depends=_rel("csrc/include/ember/*.h") + ["python/ember/_tf_kernel.h"],
    ))

if sysconfig.get_platform().startswith("linux") is False:
    sys.exit("ember builds on Linux only (shared memory, epoll, /proc)")

setup(ext_modules=extensions, cmdclass={"build_py": BuildPyWithJars, "build_ext": BuildExt})
