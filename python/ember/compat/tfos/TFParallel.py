"""TensorFlowOnSpark's ``TFParallel.run`` on Ember: independent single-node instances.

    from ember.compat.tfos import TFParallel
    TFParallel.run(sc, inference_fn, args, num_executors=4)

Each of ``num_executors`` Spark tasks calls ``map_fn(tf_args, ctx)`` with a
TFoS ctx (``worker_num``, ``executor_id``, ``num_workers``, ``defaultFS``,
``working_dir``, ``absolute_path``); there is no cluster spec, feed or
TF_CONFIG.  ``use_barrier=True`` gang-schedules the tasks (all start or none).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ember.compat.tfos.TFCluster import _default_fs


def run(sc: Any, map_fn: Callable[[Any, Any], Any], tf_args: Any, num_executors: int,
        use_barrier: bool = True) -> None:
    """Runs ``map_fn(tf_args, ctx)`` as ``num_executors`` independent instances; returns
    when all have finished, raising the first instance's error."""
    if num_executors < 1:
        raise ValueError(f"num_executors must be >= 1, got {num_executors}")
    default_fs = _default_fs(sc)
    working_dir = os.getcwd()

    def _run(it: Any) -> Any:
        import sys

        from ember.compat.tfos._node import TFNodeContext

        worker_num = 0
        for i in it:
            worker_num = i
        if use_barrier:
            from pyspark import BarrierTaskContext

            num_workers = len(BarrierTaskContext.get().getTaskInfos())
        else:
            num_workers = num_executors
        # TFoS pinned a GPU per instance; without GPUs it hid them (CPU)
        if "CUDA_VISIBLE_DEVICES" not in os.environ and not _has_gpu():
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        ctx = TFNodeContext(worker_num, defaultFS=default_fs, working_dir=working_dir)
        ctx.num_workers = num_workers
        if isinstance(tf_args, list):
            sys.argv = tf_args
        map_fn(tf_args, ctx)
        return [0]

    rdd = sc.parallelize(list(range(num_executors)), num_executors)
    if use_barrier:
        rdd.barrier().mapPartitions(_run).collect()
    else:
        rdd.mapPartitions(_run).collect()


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")
