"""ember.yarn.run_on_yarn on the mini YARN (tests/python/hadoop_fixture.py).

Each test submits one or two small applications (an AM and 2-3 Python
containers, ~10-20 s each on 2 cores).  The experiment functions live in
yarnfuns.py, which the containers import (PYTHONPATH through ``env=``).
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import urllib.request

import pytest

from hadoop_fixture import HadoopCluster
from ember import hdfs
from ember.yarn import (NodeLabel, RunFailed, TaskSpec, ps_strategy_topology, run_on_yarn,
                        single_server_topology)
import yarnfuns

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": HERE}
SMALL = TaskSpec(memory="512 MiB", vcores=1)


def _apps(cluster: HadoopCluster) -> list:
    with urllib.request.urlopen(f"{cluster.rm_web}/ws/v1/cluster/apps", timeout=30) as r:
        return (json.load(r).get("apps") or {}).get("app") or []


def _staging_left(cluster: HadoopCluster, prefix: str) -> list:
    base = cluster.hdfs_url(f"/user/{cluster.user}/.ember")
    return [n for n in hdfs.listdir(base) if n.startswith(prefix)] if hdfs.exists(base) else []


def test_roles_rendezvous_and_allreduce_across_containers(yarn: HadoopCluster) -> None:
    m = run_on_yarn(yarnfuns.roles_and_allreduce,
                    {"chief": SMALL, "worker": TaskSpec("512 MiB", 1, instances=2)},
                    env=ENV, name="ember-test-roles", timeout=300)
    assert sorted(m.tasks) == ["chief:0", "worker:0", "worker:1"]
    assert m.attempts == 1 and m.app_id.startswith("application_")
    got = {k: t.metrics for k, t in m.tasks.items()}
    spec = got["chief:0"]["cluster_spec"]
    assert sorted(spec) == ["chief", "worker"] and len(spec["worker"]) == 2
    containers = set()
    for key, t in m.tasks.items():
        r = got[key]
        kind, index = key.split(":")
        # the role and index each task registered for are the ones the AM gave it
        assert (r["job_name"], r["task_index"]) == (kind, int(index)), key
        assert r["tf_config"] == {"cluster": spec, "task": {"type": kind, "index": int(index)}}
        assert r["cluster_spec"] == spec and r["num_workers"] == 3 and r["size"] == 3
        # chief is rank 0, then the workers in order (TF_CONFIG's and torch's ranks agree)
        assert r["rank"] == (0 if kind == "chief" else 1 + int(index))
        assert r["torch_env"]["RANK"] == str(r["rank"]) and r["torch_env"]["WORLD_SIZE"] == "3"
        assert r["sum_of_ranks"] == 0 + 1 + 2  # allreduce across three YARN containers
        assert r["gathered"] == [0, 0, 1]  # task indexes in rank order
        # the secret reached the container as a file readable by its owner only
        assert r["secret_len"] == 32 and r["secret_mode"] & 0o077 == 0, r["secret_mode"]
        assert not r["env_has_secret_bytes"]
        assert r["attempt"] == 1
        assert r["absolute_path"] == f"{yarn.fs}/user/{yarn.user}/models/x"
        # what the AM reports agrees with what the task saw
        assert t.exit_status == 0 and t.container == r["container"], (t, r["container"])
        assert t.wall_s is not None and t.wall_s > 0
        containers.add(t.container)
    assert len(containers) == 3
    assert not _staging_left(yarn, "ember-test-roles")


def test_nb_proc_per_worker_runs_one_node_per_process(yarn: HadoopCluster) -> None:
    m = run_on_yarn(yarnfuns.roles_and_allreduce,
                    {"chief": SMALL, "worker": TaskSpec(512, 1, nb_proc_per_worker=2)},
                    env=ENV, name="ember-test-nbproc", timeout=300)
    assert sorted(m.tasks) == ["chief:0", "worker:0", "worker:1"]
    w0, w1 = m["worker:0"], m["worker:1"]
    # two processes of one YARN container, each its own node and rank
    assert w0.container == w1.container != m["chief:0"].container
    assert w0.metrics["container"] == w1.metrics["container"] == w0.container
    assert [m[t].metrics["rank"] for t in ("chief:0", "worker:0", "worker:1")] == [0, 1, 2]
    assert all(t.metrics["sum_of_ranks"] == 3 for t in m.tasks.values())


def test_failed_task_is_retried_with_files_and_packed_env(yarn: HadoopCluster,
                                                          tmp_path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("shipped with files=")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "a.json").write_text('{"k": 7}')
    # a "packed environment": bin/python in an archive, a wrapper around this
    # interpreter that marks the processes it starts
    env_dir = tmp_path / "env" / "bin"
    env_dir.mkdir(parents=True)
    (env_dir / "python").write_text(
        "#!/bin/sh\nexport EMBER_TEST_PYENV=packed\nexport EMBER_TEST_PYENV_ARGV0=\"$0\"\n"
        f"exec {sys.executable} \"$@\"\n")
    (env_dir / "python").chmod(0o755)
    packed = tmp_path / "env.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(env_dir, arcname="bin")
    m = run_on_yarn(yarnfuns.fails_on_first_attempt,
                    {"chief": SMALL, "worker": SMALL}, env=ENV, nb_retries=1,
                    files={"notes.txt": str(notes), "assets": str(assets)},
                    pyenv_zip_path=str(packed), name="ember-test-retry", timeout=300)
    assert m.attempts == 2 and len(set(m.app_ids)) == 2
    for key in ("chief:0", "worker:0"):
        r = m[key].metrics
        assert r["attempt"] == 2, key
        assert r["notes"] == "shipped with files=" and r["asset"] == {"k": 7}
        assert r["pyenv_marker"] == "packed" and r["python"] == "./pyenv/bin/python"
    assert not _staging_left(yarn, "ember-test-retry")


def test_failure_without_retry_names_task_traceback_and_logs(yarn: HadoopCluster) -> None:
    with pytest.raises(RunFailed) as ei:
        run_on_yarn(yarnfuns.always_fails, {"chief": SMALL, "worker": SMALL}, env=ENV,
                    name="ember-test-fail", timeout=300)
    e = ei.value
    text = str(e)
    assert e.task == "worker:0" and len(e.app_ids) == 1
    assert "task worker:0 failed" in text and "exit status 1" in text
    # the traceback, with the failing source line, and the container's output
    assert 'raise ValueError("the worker\'s data is bad (injected)")' in text
    assert "ValueError: the worker's data is bad (injected)" in e.traceback
    assert "worker 0 about to fail" in e.logs.get("stdout", "")
    assert "ValueError" in e.logs.get("stderr", "")  # the container log has it too
    assert not _staging_left(yarn, "ember-test-fail")


def test_custom_task_module_and_a_task_that_dies_before_registering(
        yarn: HadoopCluster) -> None:
    with pytest.raises(RunFailed) as ei:
        run_on_yarn(yarnfuns.plain_value, {"chief": SMALL, "worker": SMALL}, env=ENV,
                    custom_task_module="yarn_custom_task", name="ember-test-custom",
                    timeout=300)
    e = ei.value
    assert e.task == "worker:0" and e.traceback == ""
    assert "exit status 3" in str(e)
    assert "worker exits before registering" in e.logs.get("stderr", "")


def test_bad_task_specs_fail_before_submitting(yarn: HadoopCluster) -> None:
    before = len(_apps(yarn))
    bad = [
        ({"chief": SMALL, "master": SMALL}, "unknown task type 'master'"),
        ({"chief": SMALL, "worker": TaskSpec("1 GiB", 1, instances=0)},
         r"task_specs\['worker'\].instances must be >= 1, got 0"),
        ({"chief": TaskSpec("1 GiB", 1, instances=2)}, "'chief'.*must be 1"),
        ({"evaluator": SMALL}, "needs a 'chief' or a 'worker'"),
        ({"chief": TaskSpec("2 XB", 1)}, "memory '2 XB'"),
        ({"chief": TaskSpec(512, 0)}, "vcores must be >= 1"),
        ({"chief": TaskSpec(512, 1, nb_proc_per_worker=2)}, "nb_proc_per_worker must be 1"),
        ({"chief": TaskSpec(512, 1, label="gpu")}, "must be a NodeLabel"),
        ({}, "non-empty"),
    ]
    for specs, match in bad:
        with pytest.raises(ValueError, match=match):
            run_on_yarn(yarnfuns.roles_and_allreduce, specs, env=ENV)
    with pytest.raises(ValueError, match="nb_retries"):
        run_on_yarn(yarnfuns.roles_and_allreduce, {"chief": SMALL}, nb_retries=-1)
    with pytest.raises(ValueError, match="pyenv_zip_path"):
        run_on_yarn(yarnfuns.roles_and_allreduce, {"chief": SMALL}, pyenv_zip_path=__file__)
    with pytest.raises(ValueError, match=r"files\['data'\]: '/nonexistent/x' does not exist"):
        run_on_yarn(yarnfuns.roles_and_allreduce, {"chief": SMALL},
                    files={"data": "/nonexistent/x"})
    # larger than the cluster's largest container (asked the RM, nothing submitted)
    with pytest.raises(ValueError, match="asks for 65536 MiB; the cluster's largest"):
        run_on_yarn(yarnfuns.roles_and_allreduce, {"chief": TaskSpec("64 GiB", 1)}, env=ENV,
                    name="ember-test-too-big")
    assert len(_apps(yarn)) == before  # nothing reached the ResourceManager
    assert not _staging_left(yarn, "ember-test-too-big")


def test_a_hung_task_is_killed_at_the_timeout(yarn: HadoopCluster) -> None:
    with pytest.raises(RunFailed, match="timed out after 15 s") as ei:
        run_on_yarn(yarnfuns.hangs, {"chief": SMALL}, env=ENV, name="ember-test-timeout",
                    timeout=15)
    app = [a for a in _apps(yarn) if a["id"] == ei.value.app_ids[0]][0]
    assert app["state"] == "KILLED"


def test_topologies_and_memory_sizes() -> None:
    assert single_server_topology("1 GiB", 2) == {"chief": TaskSpec("1 GiB", 2)}
    t = ps_strategy_topology(nb_workers=3, nb_ps=2, memory=2048, vcores=1, evaluator=True,
                             tensorboard=True)
    assert sorted(t) == ["chief", "evaluator", "ps", "tensorboard", "worker"]
    assert (t["worker"].instances, t["ps"].instances, t["chief"].instances) == (3, 2, 1)
    assert sorted(ps_strategy_topology()) == ["chief", "ps", "worker"]
    assert [TaskSpec(m, 1).memory_mb for m in (512, "2 GiB", "2GB", "1.5g", "100 MiB")] == \
        [512, 2048, 1908, 1536, 100]
    assert TaskSpec(1, 1).label is NodeLabel.CPU and NodeLabel.GPU.value == "gpu"


def test_tensorboard_task_serves_until_the_chief_is_done(yarn: HadoopCluster,
                                                         tmp_path) -> None:
    logs = tmp_path / "tb"
    m = run_on_yarn(yarnfuns.reads_tensorboard, {"chief": SMALL, "tensorboard": SMALL},
                    env=dict(ENV, EMBER_YARN_TENSORBOARD_DIR=f"file://{logs}"),
                    name="ember-test-tensorboard", timeout=400)
    r = m["chief:0"].metrics
    assert r["status"] == 200 and r["logdir"]["logdir"] == str(logs)
    assert m.tensorboard_url == r["url"]
    tb = m["tensorboard:0"]
    assert tb.stopped and tb.container and tb.metrics is None  # stopped by the AM at the end
