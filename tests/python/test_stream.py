"""Training from Structured Streaming (``Cluster.train_stream``) on the
embedded local[4] Spark: every record of a file stream and of a rate stream
is trained exactly once across a stopped and restarted query and across a
SIGKILLed node restarted by ``max_restarts``, counted by the ids the nodes'
checkpoints hold (streamfuns.checkpointed_ids)."""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest

import streamfuns
from ember.spark import EmberNodeError, InputMode, run


def _once(ids, expected):
    counts = collections.Counter(ids)
    repeated = {i: c for i, c in counts.items() if c > 1}
    assert not repeated, f"trained more than once: {sorted(repeated.items())[:20]}"
    missing = sorted(set(expected) - set(counts))
    assert not missing, f"never trained: {missing[:20]} ({len(missing)} in all)"
    assert set(counts) == set(expected)


def _wait_mid(out, node, micro_batch, below):
    """Waits until ``node`` has read some, and fewer than ``below``, records
    of ``micro_batch``."""
    return streamfuns.wait_for(
        f"node {node} in the middle of micro-batch {micro_batch}",
        lambda: (lambda s: s.get("micro_batch") == micro_batch and 0 < s.get("read", 0) < below)(
            streamfuns.live(str(out), node)))


def test_file_stream_query_stopped_or_failed_mid_micro_batch_and_restarted(local_spark,
                                                                           tmp_path):
    """8 files, one per micro-batch, to 2 nodes that checkpoint every 2nd
    micro-batch.  The query is stopped while node 0 reads micro-batch 2, and
    started again from its checkpoint location.  Then the feeding job of a
    later micro-batch fails half-way (a task raises), which fails the query;
    started again, it feeds that micro-batch to the running nodes again, and
    they get only the records they lacked (the feed's delivery record)."""
    src, out, ckpt = tmp_path / "src", tmp_path / "out", str(tmp_path / "ckpt")
    out.mkdir()
    files, per_file = 8, 400
    streamfuns.write_id_files(str(src), files, per_file)
    spark = local_spark
    df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).json(str(src))
    cluster = run(spark.sparkContext, streamfuns.checkpointed_ids,
                  {"out": str(out), "step": 0.05, "batch": 25, "every": 2},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60)
        _wait_mid(out, 0, 2, per_file / 2 - 25)
        query.stop()
        assert not query.isActive and query.exception() is None
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60)
        streamfuns.wait_for("node 0 to read micro-batch 3",
                            lambda: 3 in streamfuns.live(str(out), 0).get("done", []))
        # the next micro-batch's first feeding task raises after 50 rows
        # (sent 25 rows at a time: 8-byte rows, 200-byte chunks)
        cluster.chunk_bytes, cluster._fault_feed_fail_at = 200, (0, 50)
        with pytest.raises(Exception, match="injected failure of partition 0 after 50 rows"):
            query.awaitTermination(60)
        cluster._fault_feed_fail_at = None
        failed_in = max(streamfuns.live(str(out), i)["micro_batch"] for i in (0, 1))
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60)
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        cluster.shutdown(timeout=60)
    assert not query.isActive
    _once(streamfuns.trained_ids(str(out), 2), range(files * per_file))
    for i in (0, 1):  # every node had a round for every micro-batch, in order
        assert streamfuns.live(str(out), i)["done"] == list(range(files))
    assert 4 <= failed_in < files
    # the feed log dropped what both nodes' checkpoints held (ctx.checkpointed)
    logged = sorted(int(n) for n in os.listdir(os.path.join(ckpt, "ember-feed-log")))
    assert logged and logged[0] >= 4 and logged[-1] == files - 1, logged


def _rate_stream_cluster(spark, out, rows_per_s, every, max_restarts=0, slow=(None, 0)):
    """A rate stream of ``id``s and 2 nodes training on it
    (streamfuns.checkpointed_ids, a checkpoint every ``every`` micro-batches;
    ``slow``: its micro-batch and step)."""
    out.mkdir()
    df = (spark.readStream.format("rate").option("rowsPerSecond", rows_per_s)
          .option("numPartitions", 2).load().selectExpr("value AS id"))
    cluster = run(spark.sparkContext, streamfuns.checkpointed_ids,
                  {"out": str(out), "step": 0.02, "batch": 20, "every": every, "slow": slow},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60,
                  heartbeat_timeout=4, max_restarts=max_restarts)
    return df, cluster


def test_rate_stream_node_killed_restarts_and_resumes_from_its_checkpoint(local_spark,
                                                                          tmp_path):
    """A rate source, 2 nodes, max_restarts=1: node 1 is SIGKILLed while it
    reads a micro-batch; both nodes restart from their checkpoints, the
    micro-batches after them are fed again from the stream's feed log (Spark
    had committed some), and every row the query produced is trained once."""
    out, ckpt = tmp_path / "out", str(tmp_path / "ckpt")
    # micro-batch 5, after which the nodes checkpoint, is slow in their
    # first run (0.5 s a step): the victim cannot finish it between the wait
    # and the kill, however loaded the machine is
    df, cluster = _rate_stream_cluster(local_spark, out, 300, every=3, max_restarts=1,
                                       slow=(5, 0.5))
    try:
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60,
                                     trigger={"processingTime": "500 milliseconds"})
        victim = streamfuns.wait_for(
            "node 1 in micro-batch 5, after its checkpoint",
            lambda: (lambda s: s if s.get("micro_batch") == 5 and s.get("read", 0) > 0
                     and 5 not in s["done"] else None)(
                streamfuns.live(str(out), 1)))
        os.kill(victim["pid"], signal.SIGKILL)
        streamfuns.wait_for("the restarted nodes to read 3 micro-batches",
                            lambda: all(streamfuns.live(str(out), i).get("restart") == 1 and
                                        len(streamfuns.live(str(out), i)["done"]) >= 3
                                        for i in (0, 1)))
        assert query.isActive and query.exception() is None
    finally:
        cluster.shutdown(timeout=60)
    assert cluster.restarts == 1 and cluster.restart_causes[0].node == 1
    restarted = [streamfuns.live(str(out), i) for i in (0, 1)]
    # each resumed from its own checkpoint (node 0's may be its last save,
    # when the restart stopped it between micro-batches), the killed node's
    # from before the micro-batch it was in: fed again, from the feed log
    assert 0 < restarted[1]["start"] <= victim["micro_batch"], json.dumps([victim, restarted])
    assert all(s["done"][0] == s["start"] for s in restarted), restarted
    ids = streamfuns.trained_ids(str(out), 2)
    _once(ids, range(len(ids)))  # the rate source numbers its rows 0, 1, 2, ...


def test_driver_killed_mid_stream_and_started_again(tmp_path):
    """The whole driver (Python and its JVM) is SIGKILLed while its nodes
    read micro-batch 3; the nodes end by themselves (heartbeats).  A new
    driver with the same checkpoint location starts new nodes, which restore
    their checkpoints; the stream goes on from what they lack, partly from
    the feed log (Spark had committed it).  Every record is trained once.
    Its own driver processes, not the shared session: the test kills one."""
    import subprocess
    import sys
    import time

    src, out, ckpt = tmp_path / "src", tmp_path / "out", str(tmp_path / "ckpt")
    out.mkdir()
    files, per_file = 8, 400
    streamfuns.write_id_files(str(src), files, per_file)
    driver = [sys.executable, os.path.join(os.path.dirname(__file__), "stream_driver.py"),
              str(src), str(out), ckpt]
    with open(tmp_path / "driver-1.log", "w") as log:
        # micro-batch 3's steps are slow (0.5 s) in this first run: the nodes,
        # which read its end in 0.4 s at the usual pace, were seen finishing it
        # between the wait below and the kill on a loaded machine
        first = subprocess.Popen(driver + ["3"], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        _wait_mid(out, 0, 3, per_file / 2 - 25)
        killed = [streamfuns.live(str(out), i) for i in (0, 1)]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

    def gone(pid):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True

    streamfuns.wait_for("the nodes to end without their driver",
                        lambda: all(gone(s["pid"]) for s in killed), timeout=30)
    started = time.monotonic()
    with open(tmp_path / "driver-2.log", "w") as log:
        second = subprocess.run(driver, stdout=log, stderr=subprocess.STDOUT, timeout=240)
    assert second.returncode == 0, (tmp_path / "driver-2.log").read_text()[-4000:]
    assert (out / "driver-done").exists() and time.monotonic() - started < 240
    again = [streamfuns.live(str(out), i) for i in (0, 1)]
    # each node resumed from its checkpoint (every 2nd micro-batch: 2 at most)
    assert all(0 < s["start"] <= 3 and s["done"][0] == s["start"] for s in again), again
    assert all(s["done"][-1] == files - 1 for s in again), again
    _once(streamfuns.trained_ids(str(out), 2), range(files * per_file))


def test_node_failure_without_restarts_fails_the_query_naming_the_node(local_spark, tmp_path):
    out, ckpt = tmp_path / "out", str(tmp_path / "ckpt")
    df, cluster = _rate_stream_cluster(local_spark, out, 200, every=1000)
    try:
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60,
                                     trigger={"processingTime": "500 milliseconds"})
        victim = streamfuns.wait_for("node 0 reading", lambda: (
            lambda s: s if s.get("read", 0) > 0 else None)(streamfuns.live(str(out), 0)))
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(Exception) as info:
            query.awaitTermination(60)
        assert "EmberNodeError: ember node 0 (chief:0" in str(info.value), str(info.value)
    finally:
        cluster.shutdown(timeout=60)  # the failure stopped the cluster: nothing left to stop
    assert isinstance(cluster.failure(), EmberNodeError) and cluster.failure().node == 0


def test_train_refuses_a_stream_and_train_stream_a_batch(local_spark, tmp_path):
    spark = local_spark
    cluster = run(spark.sparkContext, streamfuns.checkpointed_ids, {"out": str(tmp_path)},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60)
    try:
        stream = spark.readStream.format("rate").load()
        with pytest.raises(ValueError, match="train_stream"):
            cluster.train(stream)
        with pytest.raises(ValueError, match="streaming DataFrame"):
            cluster.train_stream(spark.range(3), checkpoint_location=str(tmp_path / "c"))
        with pytest.raises(ValueError, match="checkpoint_location"):
            cluster.train_stream(stream)
    finally:
        cluster.shutdown(timeout=60)
