"""ember.tf.allreduce: the TensorFlow op EmberAllreduce (_tf_allreduce_op.c)
between ranks that are processes on loopback (test_collective's worlds),
inside tf.function and eagerly, checked against numpy; a peer that leaves
fails the op with TensorFlow's error naming the rank, and an op whose
collective is closed fails cleanly."""
from __future__ import annotations

import time
from typing import Any, Dict, List

import numpy as np
import pytest

from test_collective import SECRET, run_world


def rank_tf_allreduce(rank: int, n: int, addresses: List[str], fd: int) -> Dict[str, Any]:
    import tensorflow as tf

    import ember.tf
    from ember.collective import Collective

    coll = Collective(rank, addresses, SECRET, listen_fd=fd, timeout=30)
    rng = np.random.default_rng(rank)
    grads = rng.standard_normal((3, 5)).astype(np.float32)
    counts = np.array([rank, 10 * rank, -rank], np.int64)
    variable = tf.Variable(tf.zeros([3, 5]))

    @tf.function
    def step(g: Any, flag: Any) -> Any:
        # as a training step: gradients and a flag in one buffer, reduced, applied
        flat = tf.concat([tf.reshape(g, [-1]), tf.reshape(flag, [1])], 0)
        summed = ember.tf.allreduce(flat, coll)
        variable.assign_add(tf.reshape(summed[:-1], [3, 5]))
        return summed[-1]

    flags = [float(step(grads, tf.constant(1.0))) for _ in range(3)]
    avg = ember.tf.allreduce(tf.constant(grads, tf.float64), coll, op="mean").numpy()
    top = ember.tf.allreduce(counts, coll, op="max").numpy()
    empty = ember.tf.allreduce(tf.zeros([0], tf.int32), coll).numpy()
    with pytest.raises(ValueError, match="op must be one of"):
        ember.tf.allreduce(grads, coll, op="prod")
    with pytest.raises(TypeError, match="not uint8"):
        ember.tf.allreduce(tf.zeros([2], tf.uint8), coll)
    # a peer that leaves mid-collective: the op fails naming it, within seconds
    if rank == 1:
        time.sleep(0.5)
        coll.close()
        return {"variable": variable.numpy()}
    t0 = time.monotonic()
    with pytest.raises((tf.errors.AbortedError, tf.errors.UnavailableError)) as err:
        step(grads, tf.constant(1.0))
    took = time.monotonic() - t0
    coll.close()
    with pytest.raises(tf.errors.FailedPreconditionError, match="no communicator"):
        step(grads, tf.constant(1.0))
    return {"variable": variable.numpy(), "flags": flags, "avg": avg, "top": top,
            "empty": empty.shape, "error": err.value.message, "took": took}


@pytest.mark.timeout(180)
def test_tf_allreduce_in_a_step_matches_numpy_and_fails_on_a_lost_peer() -> None:
    r0, r1 = run_world(2, rank_tf_allreduce)
    assert r0["variable"].tobytes() == r1["variable"].tobytes()  # the same bits on both
    grads = [np.random.default_rng(r).standard_normal((3, 5)).astype(np.float32)
             for r in range(2)]
    np.testing.assert_allclose(r0["variable"], 3 * (grads[0] + grads[1]), rtol=1e-6)
    assert r0["flags"] == [2.0, 2.0, 2.0]
    np.testing.assert_allclose(r0["avg"], (grads[0].astype(np.float64) + grads[1]) / 2)
    assert r0["top"].tolist() == [1, 10, 0] and r0["empty"] == (0,)
    assert "rank 1" in r0["error"], r0["error"]
    assert r0["took"] < 10, r0
