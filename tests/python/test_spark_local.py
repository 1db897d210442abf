"""Ember on an embedded local[4] Spark: reservation, roles, feed, failures."""

from __future__ import annotations

import collections
import glob
import importlib.util
import json
import os
import time

import pytest

import nodefuns
from conftest import read_json_files, wait_gone
from ember import _ember
from ember.spark import EmberNodeError, InputMode, run


def _live_sockets_on(ports):
    """Sockets bound to any of these local ports, except TIME_WAIT leftovers."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                port, state = int(fields[1].rsplit(":", 1)[1], 16), fields[3]
                if port in ports and state != "06":  # 06 = TIME_WAIT
                    found.append((table, port, state))
    return found


@pytest.mark.parametrize("n", [2, 4])
def test_reservation_assigns_roles_and_tf_config(local_spark, tmp_path, n):
    sc = local_spark.sparkContext
    num_ps = 1 if n == 4 else 0
    # a lambda in args: pickled by value, so the boot record needs cloudpickle's own code
    cluster = run(sc, nodefuns.report_ctx, {"out": str(tmp_path), "by_value": lambda: n},
                  num_executors=n,
                  num_ps=num_ps, eval_node=(n == 4), input_mode=InputMode.TENSORFLOW,
                  reservation_timeout=60)
    cluster.shutdown(timeout=60)
    infos = read_json_files(str(tmp_path))
    assert sorted(i["index"] for i in infos) == list(range(n))
    # the standalone cloudpickle's boot record loads without pyspark (0.4 CPU
    # s a node); .venv-compat has only pyspark's copy, whose code for what
    # it pickled by value (the lambda) the node imports with pyspark
    standalone = importlib.util.find_spec("cloudpickle") is not None
    assert [i["pyspark_imported"] for i in infos] == [not standalone] * n
    roles = {i["index"]: (i["job_name"], i["task_index"]) for i in infos}
    if n == 2:
        assert roles == {0: ("chief", 0), 1: ("worker", 0)}
    else:  # TensorFlowOnSpark's order: ps, chief, evaluator, workers
        assert roles == {0: ("ps", 0), 1: ("chief", 0), 2: ("evaluator", 0), 3: ("worker", 0)}
    for info in infos:
        tf_config = json.loads(info["tf_config"])
        assert tf_config["task"] == {"type": info["job_name"], "index": info["task_index"]}
        assert "evaluator" not in tf_config["cluster"]
        assert tf_config["cluster"] == info["cluster_spec"]
        assert info["num_workers"] == (2 if n == 2 else 2)
    # torch.distributed: chief and workers are ranks 0..W-1, rank 0 is the master
    trainers = sorted((i for i in infos if i["job_name"] in ("chief", "worker")),
                      key=lambda i: i["index"])
    for rank, info in enumerate(trainers):
        env = info["torch_env"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), str(len(trainers)))
        assert env["MASTER_PORT"] == str(trainers[0]["ports"][0])
    for info in infos:
        if info["job_name"] not in ("chief", "worker"):
            assert info["torch_env"]["RANK"] is None
    # ports are distinct per node and were really reserved
    ports = [p for i in infos for p in i["ports"]]
    assert len(ports) == len(set(ports)) == 3 * n  # framework, feed, collectives


def test_node_exception_is_raised_on_driver(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.raise_on_node, {"out": str(tmp_path), "bad": 1},
                  num_executors=2, input_mode=InputMode.TENSORFLOW, reservation_timeout=60)
    with pytest.raises(EmberNodeError) as err:
        cluster.shutdown(timeout=60)
    text = str(err.value)
    assert "node 1" in text and "boom from node 1" in text
    assert "Traceback" in text and "ValueError" in text
    assert err.value.node == 1


def test_node_exception_during_train_stops_the_feed(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.train_then_raise, {}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    rdd = sc.parallelize([(i, [float(i)]) for i in range(20000)], 4)
    start = time.monotonic()
    with pytest.raises(EmberNodeError) as err:
        cluster.train(rdd, num_epochs=3, feed_timeout=60)
    assert time.monotonic() - start < 45
    assert "trainer exploded after its first batch" in str(err.value)
    assert "Traceback" in str(err.value)
    # the failure already stopped every node; shutdown() is then a no-op
    assert wait_gone([n["pid"] for n in cluster.nodes]) == []
    cluster.shutdown(timeout=30)


def test_reservation_timeout_names_the_missing_node(local_spark):
    sc = local_spark.sparkContext
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        run(sc, nodefuns.report_ctx, {"out": "/nonexistent"}, num_executors=2,
            input_mode=InputMode.TENSORFLOW, reservation_timeout=4,
            env={"EMBER_FAULT_DELAY_REGISTER": "1:8"})
    assert time.monotonic() - start < 30
    assert "missing node(s): 1" in str(err.value)


def test_train_delivers_every_record_once_per_epoch(local_spark, tmp_path):
    sc = local_spark.sparkContext
    n, epochs = 5000, 3
    # uneven partitions on purpose (one is empty)
    data = [(i, [float(i)] * 4) for i in range(n)]
    rdd = sc.parallelize(data, 7).mapPartitionsWithIndex(
        lambda p, it: it if p != 3 else iter(()))
    expected = collections.Counter(r[0] for r in rdd.collect())
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path), "check_rows": True},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    fed = cluster.train(rdd, num_epochs=epochs)
    cluster.shutdown(timeout=60)
    assert fed == sum(expected.values()) * epochs
    infos = read_json_files(str(tmp_path))
    assert len(infos) == 2
    got = collections.Counter(i for info in infos for i in info["ids"])
    assert got == collections.Counter({k: v * epochs for k, v in expected.items()})
    # both feeding nodes got data, and batches were full except at the end
    # and where the next batch is of another epoch (a batch never mixes two)
    assert all(info["ids"] for info in infos)
    by_epoch = collections.defaultdict(collections.Counter)
    for info in infos:
        ends = [e != after for e, after in zip(info["epochs"], info["epochs"][1:])]
        assert all(s == 32 or end for s, end in zip(info["sizes"], ends))
        at = 0
        for e, s in zip(info["epochs"], info["sizes"]):
            by_epoch[e].update(info["ids"][at:at + s])
            at += s
    # and the batches labelled epoch e (feed.epoch) hold the data once each
    assert by_epoch == {e: expected for e in range(epochs)}


def test_inference_returns_one_result_per_record_in_order(local_spark):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.double_it, {"batch": 37}, num_executors=2,
                  input_mode=InputMode.SPARK, master_node=None, reservation_timeout=60)
    try:
        rdd = sc.parallelize([(i, float(i) / 2) for i in range(3001)], 5)
        out = cluster.inference(rdd).collect()
    finally:
        cluster.shutdown(timeout=60)
    assert out == [[i, float(i)] for i in range(3001)]


def test_shutdown_leaves_no_process_port_or_segment(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    cluster.train(sc.parallelize([(i, [1.0]) for i in range(100)], 2))
    cluster.shutdown(timeout=60)
    infos = read_json_files(str(tmp_path))
    assert wait_gone([i["pid"] for i in infos]) == []
    ports = {p for info in infos for p in info["ports"]}
    assert _live_sockets_on(ports) == []
    assert glob.glob("/dev/shm/ember*") == []


def test_wrong_secret_is_rejected_and_cluster_keeps_working(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        port = cluster._server.port
        with pytest.raises(_ember.EmberAuthError):
            _ember.RendezvousClient("127.0.0.1", port, b"not the secret, 32 bytes long!!", 5.0)
        node = cluster.nodes[0]
        with pytest.raises(_ember.EmberAuthError):
            _ember.FeedClient(node["host"], node["ports"][1], b"x" * 32, 1, timeout_s=5.0)
        assert cluster.train(sc.parallelize([(i, [1.0]) for i in range(500)], 3)) == 500
    finally:
        cluster.shutdown(timeout=60)
    assert sum(len(i["ids"]) for i in read_json_files(str(tmp_path))) == 500


def test_driver_ps_nodes_run_on_the_driver(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, nodefuns.wait_for_feed_end, {"out": str(tmp_path)}, num_executors=3,
                  num_ps=1, driver_ps_nodes=True, input_mode=InputMode.SPARK,
                  reservation_timeout=60)
    try:
        fed = cluster.train(sc.parallelize([[i] for i in range(100)], 4), 1)
    finally:
        cluster.shutdown(timeout=60)
    assert fed == 100
    infos = {i["index"]: i for i in read_json_files(str(tmp_path))}
    assert infos[0]["job_name"] == "ps" and infos[0]["spark_executor"] == "driver"
    assert {infos[1]["job_name"], infos[2]["job_name"]} == {"chief", "worker"}
    assert all(infos[i]["spark_executor"] != "driver" for i in (1, 2))
    assert not wait_gone([i["pid"] for i in infos.values()])


def test_tensorboard_served_by_the_chief_until_shutdown(local_spark, tmp_path):
    import urllib.request

    sc = local_spark.sparkContext
    log_dir = tmp_path / "tb"
    cluster = run(sc, nodefuns.wait_for_feed_end, {"out": str(tmp_path)}, num_executors=2,
                  tensorboard=True, log_dir=str(log_dir), input_mode=InputMode.SPARK,
                  reservation_timeout=60)
    try:
        url = cluster.tensorboard_url()
        chief = next(n for n in cluster.nodes if n["role"] == "chief")
        assert url == f"http://{chief['host']}:{chief['ports'][2]}"
        deadline, body = time.monotonic() + 90, b""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/data/logdir", timeout=5) as r:
                    body = r.read()
                break
            except OSError:
                time.sleep(0.5)
        assert str(log_dir).encode() in body, f"TensorBoard did not answer at {url}"
    finally:
        cluster.shutdown(timeout=60)
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 15
    while _live_sockets_on({port}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _live_sockets_on({port}), "TensorBoard outlived shutdown"
