"""Ember on a real Spark standalone cluster (Master + 2 Workers on loopback).

Each Worker runs its own executor JVM with one slot, so the two barrier tasks
land on different executors, and the feeding tasks of ``train`` can only run
because the nodes were detached from their launching tasks.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import numpy as np
import pytest

import nodefuns
from conftest import read_json_files, signal_node_when_ready
from connect_fixture import ConnectServer, run_client, skip_without_server_jar
from ember import _ember
from ember.errors import EmberFeedError
from ember.spark import EmberNodeError, InputMode, run
from test_feed_spark import lockstep_epochs


def test_feeding_tasks_prefer_distinct_executors_caching_their_partitions(cluster_spark):
    """NodeGroups gives each node's feeding task the executor caching most
    of its partitions, a different one for each task: without a location of
    its own, a task takes its first partition's, and two feeders that prefer
    one busy 1-core executor wait spark.locality.wait (docs/performance.md).
    It must know where the blocks are right after the job that cached them,
    when the scheduler's own answer (getPreferredLocs) still says nowhere."""
    from ember import _grouping

    sc = cluster_spark.sparkContext
    jsc = sc._jsc.sc()

    def locations(jrdd, index):
        seq = jsc.getPreferredLocs(jrdd, index)
        return [str(seq.apply(j).toString()) for j in range(seq.size())]

    rdd = sc.parallelize(range(8000), 8).cache()
    try:
        rdd.count()  # caches it: the next grouping runs before any other job
        chosen = {}
        for first in (0, 1):  # the call's numbering shifts which partitions a node gets
            grouped = _grouping.java_class(sc).groupPython(rdd._jrdd, 2, first, 8, None).rdd()
            chosen[first] = [locations(grouped, g) for g in range(2)]
        rdd.count()  # a job: the scheduler now knows where the blocks are
        cached = {i: locations(rdd._jrdd.rdd(), i) for i in range(8)}
        assert all(len(v) == 1 and v[0].startswith("executor_") for v in cached.values()), cached
        for first, groups in chosen.items():
            assert all(len(c) == 1 for c in groups) and groups[0] != groups[1], (groups, cached)
            mine = [collections.Counter(cached[i][0] for i in range(8) if (first + i) % 2 == g)
                    for g in range(2)]
            for g, [where] in enumerate(groups):
                # an executor caching some of its partitions, or (when the
                # other group took that one) that executor's host
                assert where in mine[g] or any(c.split("_")[1] == where for c in mine[g]), \
                    (first, g, where, mine)
            pairs = sorted(((n, loc, g) for g in range(2) for loc, n in mine[g].items()),
                           reverse=True)
            if len(pairs) == 1 or pairs[0][0] > pairs[1][0]:  # the strongest preference is kept
                assert groups[pairs[0][2]] == [pairs[0][1]], (pairs, groups)
    finally:
        rdd.unpersist()


def test_two_node_training_on_two_executors(cluster_spark, tmp_path):
    sc = cluster_spark.sparkContext
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
    try:
        assert len({n["executor_id"] for n in cluster.nodes}) == 2
        rdd = sc.parallelize([(i, [float(i)] * 8) for i in range(4000)], 6)
        assert cluster.train(rdd, num_epochs=2) == 8000
    finally:
        cluster.shutdown(timeout=120)
    got = collections.Counter(i for info in read_json_files(str(tmp_path)) for i in info["ids"])
    assert got == collections.Counter({i: 2 for i in range(4000)})


def test_nodes_of_two_executors_are_forked_by_one_server(cluster_spark, tmp_path):
    """What differs between the executors (and applications) on a host does
    not split its fork servers: each executor's directory (its stdout and
    stderr, nothing to import), on its workers' path, and the variables
    Spark sets per executor.  Both nodes are forked by one server, each
    starting in its own executor's directory, on its path, and without the
    other's on it."""
    sc = cluster_spark.sparkContext
    cluster = run(sc, nodefuns.report_fork, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, env={"EMBER_TEST_JOB": "standalone"},
                  reservation_timeout=120)
    cluster.shutdown(timeout=120)
    nodes = read_json_files(str(tmp_path))
    assert len(nodes) == 2 and all(n["preloaded"] for n in nodes), nodes
    assert len({n["ppid"] for n in nodes}) == 1, nodes
    assert len({n["cwd"] for n in nodes}) == 2, nodes  # two executors' directories
    for node, other in (nodes, nodes[::-1]):
        assert node["cwd"] in node["path"] and other["cwd"] not in node["path"], node


@pytest.mark.parametrize("kind", ["rdd", "dataframe"])
def test_synchronous_training_never_starves_a_node_on_two_executors(cluster_spark, tmp_path,
                                                                    kind):
    """Two executors of one slot each: one feeding task per node (see
    test_feed_spark.lockstep_epochs, which deadlocked here before)."""
    lockstep_epochs(cluster_spark, tmp_path, kind)


def test_reservation_timeout_names_missing_node_on_cluster(cluster_spark):
    with pytest.raises(TimeoutError) as err:
        run(cluster_spark.sparkContext, nodefuns.report_ctx, {"out": "/nonexistent"},
            num_executors=2, input_mode=InputMode.TENSORFLOW, reservation_timeout=5,
            env={"EMBER_FAULT_DELAY_REGISTER": "0:10"})
    assert "missing node(s): 0" in str(err.value)


def test_wrong_secret_rejected_on_cluster(cluster_spark, tmp_path):
    sc = cluster_spark.sparkContext
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
    try:
        with pytest.raises(_ember.EmberAuthError):
            _ember.RendezvousClient("127.0.0.1", cluster._server.port, os.urandom(32), 5.0)
        assert cluster.train(sc.parallelize([(i, [0.5]) for i in range(300)], 2)) == 300
    finally:
        cluster.shutdown(timeout=120)


def test_killed_trainer_is_seen_within_the_heartbeat_bound(cluster_spark, tmp_path):
    sc = cluster_spark.sparkContext
    # made before the kill: parallelizing 200,000 records takes seconds on a
    # loaded machine, and a kill meanwhile is seen only once train() starts
    rdd = sc.parallelize([(i, [1.0]) for i in range(200000)], 4)
    cluster = run(sc, nodefuns.sleep_in_feed, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120, heartbeat_timeout=4)
    holder: dict = {}
    killer = threading.Thread(target=signal_node_when_ready,
                              args=(str(tmp_path), holder, signal.SIGKILL))
    killer.start()
    with pytest.raises(EmberNodeError) as err:
        cluster.train(rdd, feed_timeout=60)
    seen = time.monotonic()
    killer.join()
    assert "node 1" in str(err.value) and "lost" in str(err.value)
    assert seen - holder["signalled_at"] < 4 + 10  # heartbeat bound + job cancellation
    cluster.shutdown()


def _kill_after_checkpoint(ckpt_dir: str, pid: int, holder: dict) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(ckpt_dir, "checkpoint")):  # TF's checkpoint index
            holder["killed_at"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.1)


@pytest.mark.parametrize("collective", ["ember", "mwms"])
def test_killed_trainer_restarts_from_checkpoint(cluster_spark, tmp_path, collective):
    """SIGKILL the worker mid-training: with max_restarts=1 the cluster is
    relaunched, training resumes from the chief's checkpoint and completes,
    and the model still classifies Fashion-MNIST far above chance; on the
    main job's two ways to sum gradients (Ember's collective, and
    MultiWorkerMirroredStrategy, whose collective's abort must not hide the
    killed node)."""
    import argparse

    import numpy as np
    from examples.fashion_mnist import data, model

    sc = cluster_spark.sparkContext
    n_train, n_test, epochs = 4000, 1000, 2
    images, labels = data.load_split("train")
    train = [((images[i].reshape(-1) / 255.0).astype(np.float32), int(labels[i]))
             for i in range(n_train)]
    images, labels = data.load_split("test")
    test = [((images[i].reshape(-1) / 255.0).astype(np.float32), int(labels[i]))
            for i in range(n_test)]
    args = argparse.Namespace(batch_size=64, learning_rate=2e-3, epochs=epochs,
                              train_records=n_train, checkpoint_steps=5,
                              model_dir=str(tmp_path / "model"), export_dir=str(tmp_path / "export"),
                              intra_op_threads=1, inter_op_threads=1, collective=collective)
    cluster = run(sc, model.train_spark, args, num_executors=2, input_mode=InputMode.SPARK,
                  reservation_timeout=120, heartbeat_timeout=4, max_restarts=1)
    holder: dict = {}
    try:
        worker = next(n for n in cluster.nodes if n["role"] == "worker")
        killer = threading.Thread(target=_kill_after_checkpoint,
                                  args=(str(tmp_path / "model" / "checkpoint"), worker["pid"], holder))
        killer.start()
        fed = cluster.train(sc.parallelize(train, 4), num_epochs=epochs)
        killer.join()
    finally:
        cluster.shutdown(timeout=300)
    assert "killed_at" in holder, "no checkpoint appeared before training ended"
    assert cluster.restarts == 1
    cause = cluster.restart_causes[0]
    assert f"node {worker['index']}" in str(cause) and "lost" in str(cause)
    assert cause.seen_at - holder["killed_at"] < 4 + 3  # within the heartbeat bound
    assert fed == n_train * epochs  # the restarted run was fed the whole data again
    import tensorflow as tf

    final = tf.train.latest_checkpoint(str(tmp_path / "model" / "checkpoint"))
    steps_one_run = epochs * (n_train // (64 * 2))
    assert int(final.rsplit("-", 1)[1]) > steps_one_run  # resumed, not started over

    infer = run(sc, model.infer, args, num_executors=2, input_mode=InputMode.SPARK,
                master_node=None, reservation_timeout=120)
    try:
        pairs = np.asarray(infer.inference(sc.parallelize(test, 2)).collect()).reshape(-1, 2)
    finally:
        infer.shutdown(timeout=120)
    assert len(pairs) == n_test
    accuracy = float(np.mean(pairs[:, 0] == pairs[:, 1]))
    assert accuracy > 0.6, f"accuracy {accuracy} after restart (chance is 0.1)"


@pytest.mark.parametrize("kind", ["rdd", "pickled_rdd", "dataframe"])
def test_retried_feeding_task_delivers_every_record_once(cluster_spark, tmp_path, kind):
    """Partition 1's feeding task dies after 1,500 of its 2,000 records on its
    first attempt; Spark retries it, the node tells the retry how many records
    it already holds, and every record arrives exactly once.  pickled_rdd: the
    records are fed from Spark's pickled batches (no Python function of the
    RDD's own: ember._grouping.frame_chunks), and the retry skips into a batch."""
    spark = cluster_spark
    sc = spark.sparkContext
    marks = tmp_path / "marks"
    marks.mkdir()
    if kind == "rdd":
        data = sc.parallelize([(i, [float(i)] * 8) for i in range(4000)], 2) \
            .mapPartitionsWithIndex(nodefuns.fail_first_attempt(str(marks), 1, 1500))
    elif kind == "pickled_rdd":
        data = sc.parallelize([(i, np.full(8, i, np.float32)) for i in range(4000)], 2)
        open(marks / "failed-1", "w").close()
    else:
        # The failure must happen in the feeding task itself: when an upstream
        # Python stage fails, Spark ends the Arrow stream to the feeding task
        # as if the partition were complete (see README, "Exactly the data given")
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
        data = spark.range(0, 4000, numPartitions=2).selectExpr(
            "id", "array_repeat(cast(id as float), 8) as x")
        open(marks / "failed-1", "w").close()
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
    if kind != "rdd":
        cluster._fault_feed_fail_at = (1, 1500)
        cluster.chunk_rows = 100  # 1,500 is a chunk's end: the frames' are not
    try:
        assert cluster.train(data) == 4000
    finally:
        cluster.shutdown(timeout=120)
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert os.listdir(marks) == ["failed-1"]  # the failure did happen
    infos = read_json_files(str(tmp_path))
    # the node heard of it through the feed's error marker (and kept reading)
    errors = [e for info in infos for e in info["errors"]]
    assert len(errors) == 1 and "partition 1 failed after" in errors[0], errors
    assert "injected failure of partition 1" in errors[0], errors
    # it failed mid-partition: the retry had to resume, not restart
    assert "failed after 0 records" not in errors[0], errors
    got = collections.Counter(i for info in infos for i in info["ids"])
    assert got == collections.Counter(range(4000))


def _kill_feeder(marks: str, holder: dict) -> None:
    """SIGKILLs the Python worker whose pid the hanging feeding task wrote."""
    path = os.path.join(marks, "pid-1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                holder["pid"] = int(f.read())
            time.sleep(0.5)  # let the chunks it sent reach the node's queue
            os.kill(holder["pid"], signal.SIGKILL)
            holder["killed_at"] = time.monotonic()
            return
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["rdd", "dataframe"])
def test_sigkilled_feeding_task_delivers_every_record_once(cluster_spark, tmp_path, kind):
    """Partition 1's feeding task is SIGKILLed after sending 3 chunks (1,500 of
    its 2,000 records) on its first attempt: it sends no failure notice, its
    connection just drops.  Spark retries it; the node tells the retry how
    many records it already holds, and every record arrives exactly once."""
    spark = cluster_spark
    sc = spark.sparkContext
    marks = tmp_path / "marks"
    marks.mkdir()
    if kind == "rdd":
        data = sc.parallelize([(i, [float(i)] * 8) for i in range(4000)], 2) \
            .mapPartitionsWithIndex(nodefuns.hang_first_attempt(str(marks), 1, 1500))
    else:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
        data = spark.range(0, 4000, numPartitions=2).selectExpr(
            "id", "array_repeat(cast(id as float), 8) as x")
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
    cluster.chunk_rows = 500
    if kind == "dataframe":  # the feeding task itself hangs (see the raising test above)
        cluster._fault_feed_fail_at = (1, 1500, str(marks))
    holder: dict = {}
    killer = threading.Thread(target=_kill_feeder, args=(str(marks), holder))
    killer.start()
    try:
        assert cluster.train(data, feed_timeout=120) == 4000
    finally:
        killer.join()
        cluster.shutdown(timeout=120)
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert "killed_at" in holder, "the feeding task never reached its hang"
    infos = read_json_files(str(tmp_path))
    assert [e for info in infos for e in info["errors"]] == []  # a SIGKILL sends no notice
    # the killed attempt had delivered records (so the retry had to resume)
    node1 = next(info for info in infos if info["index"] == 1)
    before = max((n for t, n in node1["stamps"] if t < holder["killed_at"]), default=0)
    assert before >= 1000, node1["stamps"][:5]
    got = collections.Counter(i for info in infos for i in info["ids"])
    assert got == collections.Counter(range(4000))


def test_bad_record_fails_the_job_at_once_despite_spark_retries(cluster_spark, tmp_path):
    """On a cluster Spark retries a failed task (spark.task.maxFailures=4), and
    a data error fails every retry the same way.  The feeding task reports it
    to the driver, which cancels the job: EmberFeedError within 2 s."""
    sc = cluster_spark.sparkContext
    stamp = str(tmp_path / "stamp")
    records = [(i, [float(i)] * (3 if i == 142 else 4)) for i in range(200)]
    data = sc.parallelize(records, 2).mapPartitionsWithIndex(nodefuns.stamp_at_end(stamp))
    cluster = run(sc, nodefuns.count_records, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
    try:
        with pytest.raises(EmberFeedError) as err:
            cluster.train(data)
        caught = time.time()
    finally:
        cluster.shutdown(timeout=120)
    assert str(err.value).splitlines()[0] == (
        "feeding partition 1: column 1: record 42 has shape (3,), earlier records have "
        "shape (4,)")
    with open(stamp) as f:
        failed = float(f.read())
    assert caught - failed < 2.0, f"EmberFeedError came {caught - failed:.1f} s after the failure"


def test_connect_client_sees_a_killed_node_with_every_slot_feeding(_sessions, tmp_path):
    """Spark Connect on the standalone cluster, whose two 1-core Workers give
    exactly as many slots as nodes: node 1 is SIGKILLed while train(df) runs
    (connect_client.py's "kill").  The feeding tasks hold both slots, so the
    client's questions to the coordinator cannot run until they end; a task
    that cannot reach its node asks the coordinator itself and fails at once,
    and the client raises EmberNodeError naming the node.  Strangers at the
    coordinator's control channel (a wrong secret, garbage) are refused and
    the cluster serves on.  Its own Connect server, on this module's
    standalone cluster: the shared one runs on local[4]; the classic session
    gives the Workers' cores up first (the last test of its lane)."""
    standalone = _sessions.standalone_cluster(_sessions.root)
    _sessions.release()
    server = ConnectServer(str(tmp_path), master=standalone.url)
    skip_without_server_jar(server)
    server.start()
    try:
        record = run_client("kill", server, str(tmp_path / "out"), 300)
    finally:
        server.stop()
    assert record["strangers"][0] == "EmberAuthError", record
    assert record["raised"] == "EmberNodeError" and record["node"] == 1, record
    assert "ember node 1 (worker:0" in record["message"], record
    assert record["after_kill"] < 30, record
