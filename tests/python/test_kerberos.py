"""Ember's HDFS client on a Kerberized grid (the ``kerberized_hadoop`` fixture:
a MiniKdc, HDFS with Kerberos on RPC and SPNEGO on WebHDFS).

Three ways in, as users have them: a ticket from ``kinit`` (a gateway or a
driver), a keytab with no ticket (KRB5_CLIENT_KTNAME: a service account),
and the HDFS delegation token in HADOOP_TOKEN_FILE_LOCATION (what YARN gives
a container and Spark its executors, which have no ticket).  Bad
credentials are named, with what to do, within 2 seconds.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Dict, Iterator

import numpy as np
import pytest

from ember import errors, hdfs, tfrecord
from hadoop_fixture import KerberizedHadoop

#: A bad credential must be named this fast (no retries, no timeouts).
NAMED_WITHIN_S = 2.0


@pytest.fixture
def grid(kerberized_hadoop: KerberizedHadoop, tmp_path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[KerberizedHadoop]:
    """The grid's client configuration in the environment, and an empty
    ticket cache of this test's own (no ticket, no token, no keytab)."""
    for var in ("HADOOP_TOKEN_FILE_LOCATION", "KRB5_CLIENT_KTNAME", "HADOOP_USER_NAME"):
        monkeypatch.delenv(var, raising=False)
    for k, v in kerberized_hadoop.client_env(str(tmp_path / "ccache")).items():
        monkeypatch.setenv(k, v)
    yield kerberized_hadoop


def _kinit(grid: KerberizedHadoop, **kw) -> None:
    grid.kinit(os.environ["KRB5CCNAME"][len("FILE:"):], **kw)


def _refused(call, *args) -> errors.EmberError:
    t0 = time.monotonic()
    with pytest.raises(errors.EmberError) as info:
        call(*args)
    took = time.monotonic() - t0
    assert took < NAMED_WITHIN_S, f"named after {took:.2f}s: {info.value}"
    return info.value


def test_a_users_ticket_reads_and_writes_hdfs(grid: KerberizedHadoop, tmp_path) -> None:
    _kinit(grid)
    base = f"hdfs:///user/{grid.user}/kerberos-ticket"
    hdfs.delete(base, recursive=True)
    hdfs.makedirs(base)
    payload = os.urandom(3 << 20)  # three 1 MiB blocks: the DataNode redirects
    hdfs.write_bytes(base + "/blob.bin", payload)
    assert hdfs.read_bytes(base + "/blob.bin") == payload
    assert hdfs.stat(base + "/blob.bin")["owner"] == grid.user
    # TFRecords through the C reader and writer, as InputMode.TENSORFLOW reads them
    assert tfrecord.write(base + "/part-0.tfrecord", {"x": np.arange(5000.0)}) == 5000
    assert sum(1 for _ in tfrecord.open_reader(base + "/part-0.tfrecord")) == 5000
    hdfs.rename(base + "/blob.bin", base + "/moved.bin")
    assert sorted(hdfs.listdir(base)) == ["moved.bin", "part-0.tfrecord"]
    # a directory round trip (a model export goes this way)
    local = tmp_path / "export"
    (local / "variables").mkdir(parents=True)
    (local / "saved_model.pb").write_bytes(b"pb")
    (local / "variables" / "v.index").write_bytes(b"ix")
    hdfs.upload(str(local), base + "/export")
    back = tmp_path / "back"
    hdfs.download(base + "/export", str(back))
    assert (back / "variables" / "v.index").read_bytes() == b"ix"


def test_webhdfs_url_without_configuration_turns_to_kerberos(
        grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """No HADOOP_CONF_DIR to say the grid is Kerberized: the NameNode's 401
    makes the client authenticate with the ticket it has."""
    _kinit(grid)
    monkeypatch.delenv("HADOOP_CONF_DIR")
    host_port = grid.webhdfs.split("://", 1)[1]
    url = f"webhdfs://{host_port}/user/{grid.user}/no-conf.bin"
    hdfs.write_bytes(url, b"negotiated")
    assert hdfs.read_bytes(url) == b"negotiated"


def test_a_keytab_without_ticket_authenticates_as_its_principal(
        grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KRB5_CLIENT_KTNAME", grid.other_keytab)
    hdfs.write_bytes("hdfs:///tmp/alice-was-here", b"a")
    assert hdfs.stat("hdfs:///tmp/alice-was-here")["owner"] == "alice"
    err = _refused(hdfs.write_bytes, f"hdfs:///user/{grid.user}/not-alices", b"x")
    assert isinstance(err, errors.EmberPermissionError)
    assert grid.other_principal in str(err) and "/user/" + grid.user in str(err)


def test_a_delegation_token_without_ticket_reads_and_writes(
        grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """A YARN container or Spark executor: no ticket, the token file only."""
    monkeypatch.setenv("HADOOP_TOKEN_FILE_LOCATION", grid.token_file)
    url = f"hdfs:///user/{grid.user}/by-token.bin"
    payload = os.urandom(2 << 20)
    hdfs.write_bytes(url, payload)
    assert hdfs.read_bytes(url) == payload
    assert hdfs.stat(url)["owner"] == grid.user


def _conf_naming_host(grid: KerberizedHadoop, tmp_path, host: str) -> str:
    """A copy of the grid's configuration that names the NameNode by host."""
    conf = tmp_path / "conf-by-ip"
    conf.mkdir()
    for name in ("core-site.xml", "hdfs-site.xml"):
        with open(os.path.join(grid.conf_dir, name)) as f:
            text = f.read()
        (conf / name).write_text(text.replace("localhost:", host + ":"))
    return str(conf)


def test_bad_credentials_are_named_with_what_to_do(grid: KerberizedHadoop, tmp_path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = "hdfs:///tmp"
    # no ticket at all
    err = _refused(hdfs.listdir, url)
    assert isinstance(err, errors.EmberAuthError)
    assert "no Kerberos ticket" in str(err) and "kinit" in str(err)
    assert "spark.kerberos.access.hadoopFileSystems" in str(err)

    # an expired ticket
    _kinit(grid, lifetime="2s")
    time.sleep(2.5)
    err = _refused(hdfs.listdir, url)
    assert f"ticket of {grid.principal}" in str(err) and "expired at" in str(err)
    assert "kinit" in str(err)

    # a NameNode addressed by a name its SPNEGO principal does not carry
    _kinit(grid)
    monkeypatch.setenv("HADOOP_CONF_DIR", _conf_naming_host(grid, tmp_path, "127.0.0.1"))
    err = _refused(hdfs.listdir, url)
    assert "no service principal HTTP/127.0.0.1" in str(err)
    assert "dfs.namenode.http-address" in str(err)
    monkeypatch.setenv("HADOOP_CONF_DIR", grid.conf_dir)


def test_bad_delegation_tokens_are_named_with_what_to_do(
        grid: KerberizedHadoop, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = "hdfs:///tmp"
    monkeypatch.setenv("HADOOP_TOKEN_FILE_LOCATION", grid.expired_token_file)
    err = _refused(hdfs.listdir, url)
    assert isinstance(err, errors.EmberAuthError)
    assert "refused the HDFS_DELEGATION_TOKEN token" in str(err) and "expired" in str(err)
    assert grid.expired_token_file in str(err) and "--keytab" in str(err)

    garbage = tmp_path / "garbage.tokens"
    garbage.write_bytes(b"HDTS\x00\x05not a token")
    monkeypatch.setenv("HADOOP_TOKEN_FILE_LOCATION", str(garbage))
    err = _refused(hdfs.listdir, url)
    assert "token file Ember cannot use" in str(err) and str(garbage) in str(err)

    monkeypatch.setenv("HADOOP_TOKEN_FILE_LOCATION", str(tmp_path / "missing.tokens"))
    err = _refused(hdfs.listdir, url)
    assert "missing.tokens" in str(err)


def test_ember_doctor_says_whether_kerberos_credentials_are_there(grid: KerberizedHadoop) -> None:
    from ember import doctor

    check = doctor.check_hadoop()
    assert check.status == doctor.WARN and "kinit" in check.fix, check
    _kinit(grid)
    check = doctor.check_hadoop()
    assert check.status == doctor.OK and f"Kerberos as {grid.principal}" in check.detail, check


# ---------------------------------------------------------------- run_on_yarn

def _on_yarn(grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> Dict[str, str]:
    """A gateway with a ticket, ready for run_on_yarn; returns the tasks' env."""
    from hadoop_fixture import BUILD_DIR, REPO

    with open(os.path.join(BUILD_DIR, "classpath.txt")) as f:
        monkeypatch.setenv("EMBER_YARN_AM_CLASSPATH", f.read().strip())
    _kinit(grid)
    # The containers get no KRB5CCNAME and this user's default cache is
    # empty: HDFS is theirs only through the token run_on_yarn obtained.
    assert not os.path.exists(f"/tmp/krb5cc_{os.getuid()}")
    here = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join([here, REPO])}


def test_run_on_yarn_trains_from_hdfs_tfrecords_on_a_kerberized_grid(
        grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """tf-yarn's run_on_yarn from a gateway with a ticket: SPNEGO to the
    ResourceManager, an HDFS delegation token for the containers (which
    read TFRecords from HDFS and write the model there with it)."""
    pytest.importorskip("tensorflow", reason="the Keras path runs in the main .venv")
    import functools

    import yarn_experiment_fns as fns
    from ember.yarn import TaskSpec, run_on_yarn

    env = _on_yarn(grid, monkeypatch)
    data = f"hdfs:///user/{grid.user}/line.tfrecord"
    model_dir = f"hdfs:///user/{grid.user}/line-model"
    hdfs.delete(model_dir, recursive=True)
    fns.line_records(data)
    m = run_on_yarn(functools.partial(fns.keras_line_records, data, model_dir),
                    {"chief": TaskSpec("2 GiB", 1)}, env=env,
                    name="ember-test-kerberos", timeout=600)
    chief = m["chief:0"].metrics
    assert chief["epochs"] == 2 and chief["metrics"]["accuracy"] > 0.9, chief
    assert hdfs.isfile(model_dir + "/export/saved_model/saved_model.pb")
    assert hdfs.stat(model_dir)["owner"] == grid.user


def test_run_on_yarn_pytorch_reads_hdfs_tfrecords_on_a_kerberized_grid(
        grid: KerberizedHadoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a PyTorch experiment (DDP)."""
    pytest.importorskip("torch", reason="torch is not installed (requirements.txt pins it)")
    import functools
    import sys

    import yarn_experiment_fns as fns
    from ember.yarn import TaskSpec, run_on_yarn

    env = _on_yarn(grid, monkeypatch)
    data = f"hdfs:///user/{grid.user}/line-torch.tfrecord"
    fns.line_records(data)
    m = run_on_yarn(functools.partial(fns.torch_line_records, data),
                    {"worker": TaskSpec("2 GiB", 1, instances=2)}, env=env,
                    python=sys.executable, name="ember-test-kerberos-torch", timeout=600)
    a, b = m["worker:0"].metrics, m["worker:1"].metrics
    assert a["kind"] == "pytorch" and (a["rank"], b["rank"]) == (0, 1)
    assert a["metrics"]["accuracy"] > 0.9, a


# ---------------------------------------------------------------- Spark on YARN

def test_main_job_and_inference_on_spark_on_kerberized_yarn_with_data_on_hdfs(
        grid: KerberizedHadoop, tmp_path) -> None:
    """The main job submitted to the Kerberized YARN from a gateway, its data
    on HDFS, in InputMode.TENSORFLOW, then dfutil and the Spark ML stages with an
    hdfs:// ExportDir (tests/python/kerberos_job.py, one Spark application).
    Spark logs in from the user's keytab and hands its executors HDFS
    delegation tokens; the executors, and Ember's nodes and inference
    workers in their containers, use those tokens; the driver's own HDFS
    calls use the user's ticket.  Its own process: a YARN driver cannot
    share the test session's local Spark."""
    import json
    import subprocess
    import sys

    import pyspark

    from hadoop_fixture import REPO

    ccache = os.environ["KRB5CCNAME"][len("FILE:"):]
    _kinit(grid)
    assert not os.path.exists(f"/tmp/krb5cc_{os.getuid()}")  # containers: tokens only
    java_home = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("java") or "")))
    krb5 = f"-Djava.security.krb5.conf={grid.krb5_conf}"
    data_dir = f"{grid.fs}/user/{grid.user}/fashion-mnist"
    conf = {
        "spark.submit.deployMode": "client",
        "spark.kerberos.principal": grid.principal,
        "spark.kerberos.keytab": grid.keytab,
        "spark.kerberos.access.hadoopFileSystems": grid.fs,
        "spark.driver.extraJavaOptions": krb5,
        "spark.yarn.am.extraJavaOptions": krb5,
        "spark.executor.extraJavaOptions": krb5,
        "spark.executor.instances": "2", "spark.executor.cores": "1",
        "spark.executor.memory": "512m", "spark.executor.memoryOverhead": "1536m",
        "spark.yarn.am.memory": "512m", "spark.yarn.maxAppAttempts": "1",
        "spark.yarn.jars": f"local:{os.path.dirname(pyspark.__file__)}/jars/*",
        "spark.yarn.appMasterEnv.JAVA_HOME": java_home,
        "spark.executorEnv.JAVA_HOME": java_home,
        "spark.pyspark.python": sys.executable,
        "spark.executorEnv.PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "python")]),
        "spark.executorEnv.HADOOP_CONF_DIR": grid.conf_dir,
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "300s",
    }
    out = tmp_path / "result.json"
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "kerberos_job.py"), "--out", str(out),
           *(f"--conf={k}={v}" for k, v in conf.items()), "--",
           "--epochs", "2", "--train-limit", "6000", "--test-limit", "1000",
           "--partitions", "4", "--work-dir", str(tmp_path / "work"), "--data-dir", data_dir]
    env = dict(os.environ, **grid.client_env(ccache), PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "python"), here]))
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=900)
    print(p.stdout[-5000:])
    assert p.returncode == 0, p.stdout[-5000:]
    r = json.loads(out.read_text())
    # 6,000 records for 2 epochs: far above chance (0.1), not the full model
    assert r["tensorflow"]["accuracy"] >= 0.7, r
    # the data is on HDFS, written by the executors with their tokens
    parts = hdfs.listdir(data_dir + "/tfrecords/train")
    assert len([n for n in parts if n.endswith(".tfrecord")]) == 4
    assert hdfs.stat(data_dir + "/csv/train")["owner"] == grid.user
    assert r["dfutil_saved"] == r["dfutil_loaded"] == 1000 and r["dfutil_labels_equal"], r
    # the SavedModel scored from HDFS by both stages as the cluster scored it
    for stage in ("ember_model", "tfmodel"):
        assert r[stage]["rows"] == 1000, r
        assert abs(r[stage]["accuracy"] - r["tensorflow"]["accuracy"]) < 1e-9, r
