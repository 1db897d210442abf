"""ctx.allreduce / broadcast / allgather / barrier between Spark barrier tasks.

The nodes are real ember.spark.run nodes (local Spark, InputMode.TENSORFLOW):
each reserved its collective port at registration, and the communicator is
built from the cluster spec with the job secret on the first call.  Every op
and dtype is checked against numpy on each node (tests/python/collfuns.py);
the loopback process tests of the same ops are in test_collective.py.
"""

from __future__ import annotations

import pytest

import collfuns
from conftest import read_json_files
from ember.spark import EmberNodeError, InputMode, run


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ctx_collectives_match_numpy(local_spark, tmp_path, ranks):
    sc = local_spark.sparkContext
    # 3 ranks: chief + 2 workers, plus an evaluator that is not part of the group
    cluster = run(sc, collfuns.every_op, {"out": str(tmp_path)},
                  num_executors=ranks + (1 if ranks == 3 else 0), eval_node=(ranks == 3),
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=60)
    cluster.shutdown(timeout=120)
    infos = read_json_files(str(tmp_path))
    members = [i for i in infos if i["role"] in ("chief", "worker")]
    assert sorted(i["rank"] for i in members) == list(range(ranks))
    for info in members:
        assert info["size"] == ranks
        assert info["rank_env"] == str(info["rank"])  # the torch.distributed RANK
        assert info["failures"] == [], info
        assert all(info["errors"]), info["errors"]  # each bad call raised
    assert "uint8" in members[0]["errors"][0] and "prod" in members[0]["errors"][1]
    assert len({i["digest"] for i in members}) == 1  # bit-identical on every rank
    others = [i for i in infos if i["role"] not in ("chief", "worker")]
    assert len(others) == (1 if ranks == 3 else 0)
    for info in others:
        assert "only chief and worker nodes" in info["error"]


def test_failed_peer_breaks_the_allreduce_fast(local_spark, tmp_path):
    sc = local_spark.sparkContext
    cluster = run(sc, collfuns.peer_fails, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=60)
    with pytest.raises(EmberNodeError, match="rank 1 fails on purpose"):
        cluster.shutdown(timeout=120)
    (info,) = read_json_files(str(tmp_path))
    assert info["first"] == 2.0
    assert info["error"] and "rank 1" in info["error"], info["error"]
    assert info["seconds"] < 30, info  # the call's timeout is 120 s
