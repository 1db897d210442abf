"""ember.spark.run on Spark on YARN (client mode) against the mini YARN: a
2-executor training + inference job (tests/python/yarn_job.py, in its own
process), with the Python environment shipped in ``spark.archives``.  The
other way, the same-host venv (``spark.pyspark.python``, yarn_job.py's
``--mode venv``), is how test_kerberos.py's main job reaches its YARN
executors: a second run of the same job here cost make test about 135 CPU
seconds for no path the two do not cover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from hadoop_fixture import HadoopCluster

pytestmark = pytest.mark.timeout(900)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _yarn_job(cluster: HadoopCluster, tmp_path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    env = dict(cluster.env(), HADOOP_USER_NAME=cluster.user, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([REPO, HERE]))
    p = subprocess.run([sys.executable, os.path.join(HERE, "yarn_job.py"), "--mode", "archive",
                        "--work", str(tmp_path / "work"), "--out", str(out), *extra],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=840)
    print(p.stdout[-6000:])
    assert p.returncode == 0, p.stdout[-4000:]
    return json.loads(out.read_text())


def _app_state(cluster: HadoopCluster, app_id: str) -> dict:
    with urllib.request.urlopen(f"{cluster.rm_web}/ws/v1/cluster/apps/{app_id}",
                                timeout=30) as r:
        return json.load(r)["app"]


def test_ember_on_spark_on_yarn_with_the_environment_in_an_archive(
        hadoop_cluster: HadoopCluster, tmp_path) -> None:
    r = _yarn_job(hadoop_cluster, tmp_path)
    assert r["master"] == "yarn" and r["app_id"].startswith("application_")
    # two executors, each in a YARN container
    containers = {e[0] for e in r["executors"]}
    assert len(r["executors"]) == 2 and all(c.startswith("container_") for c in containers)
    for _cid, ember_file, model_file, python, cwd in r["executors"]:
        assert python == sys.executable
        # imported from the unpacked archive in the container
        assert ember_file.startswith(os.path.realpath(cwd)), (ember_file, cwd)
        assert "/deps/ember/" in ember_file and "/deps/examples/" in model_file
    assert r["trained"] == 2 * 4000 and r["inferred"] == 1000  # 2 epochs
    # 4,000 records for 2 epochs: far above chance (0.1), not the full model
    assert r["accuracy"] >= 0.7, r
    app = _app_state(hadoop_cluster, r["app_id"])
    assert app["state"] == "FINISHED" and app["finalStatus"] == "SUCCEEDED", app


def test_ember_yarn_check(hadoop_cluster: HadoopCluster, tmp_path) -> None:
    env = dict(hadoop_cluster.env(), HADOOP_USER_NAME=hadoop_cluster.user,
               PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "ember", "yarn", "check"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    print(p.stdout[-3000:])
    assert p.returncode == 0, p.stdout[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in lines] == ["[ok"] * 4
    assert "container_" in lines[-1] and "application_" in lines[-1]
    assert f"({sys.executable})" in lines[-1]  # the container ran this venv's python
    # without a configuration: a clear failure, nothing else attempted
    env.pop("HADOOP_CONF_DIR")
    p = subprocess.run([sys.executable, "-m", "ember", "yarn", "check"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert p.returncode == 1 and "[FAILED] HADOOP_CONF_DIR: not set" in p.stdout
    # a configuration whose NameNode is gone: the HDFS step fails, naming it
    bad = tmp_path / "conf"
    bad.mkdir()
    for f in ("core-site.xml", "hdfs-site.xml", "yarn-site.xml"):
        text = open(os.path.join(hadoop_cluster.conf_dir, f)).read()
        (bad / f).write_text(text.replace(hadoop_cluster.webhdfs.rsplit(":", 1)[1], "1"))
    p = subprocess.run([sys.executable, "-m", "ember", "yarn", "check", "--conf-dir", str(bad),
                        "--no-container"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 1 and "[FAILED] HDFS:" in p.stdout, p.stdout
