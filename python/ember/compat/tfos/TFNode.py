"""TensorFlowOnSpark's ``TFNode`` on Ember: the node-side helpers of a ``map_fun``.

``DataFeed(ctx.mgr, train_mode, qname_in, qname_out, input_mapping)`` reads what
``cluster.train``/``cluster.inference`` send (InputMode.SPARK);
``hdfs_path(ctx, path)`` qualifies a path as TFoS did.
"""

from __future__ import annotations

from typing import Any

from ember.compat.tfos._node import DataFeed, TFManager, TFNodeContext, hdfs_path

__all__ = ["DataFeed", "hdfs_path", "release_port", "start_cluster_server", "export_saved_model",
           "next_batch", "batch_results", "terminate", "TFNodeContext", "TFManager"]


def _tf_major() -> int:
    import tensorflow as tf

    return int(tf.__version__.split(".")[0])


def start_cluster_server(ctx: Any, num_gpus: int = 1, rdma: bool = False) -> Any:
    """TF 1.x's ``tf.train.Server`` for this node; on TF 2 this raises, as in TFoS."""
    if _tf_major() >= 2:
        raise Exception("DEPRECATED: Use higher-level APIs like `tf.keras` or `tf.estimator`")
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(ctx.cluster_spec)
    protocol = "grpc+verbs" if rdma else None
    server = tf.train.Server(cluster, ctx.job_name, ctx.task_index, protocol=protocol)
    return cluster, server


def export_saved_model(sess: Any, export_dir: str, tag_set: str, signatures: Any) -> None:
    """TF 1.x SavedModel export; on TF 2 this raises, as in TFoS."""
    raise Exception("DEPRECATED: Use TF provided APIs instead.")


def release_port(ctx: Any) -> None:
    """Releases the node's hold on its TF port (``ctx.release_port()``)."""
    ctx.release_port()


def next_batch(mgr: Any, batch_size: int, qname: str = "input") -> Any:
    """*DEPRECATED* in TFoS. Use TFNode.DataFeed class instead."""
    raise Exception("DEPRECATED: Use TFNode.DataFeed class instead")


def batch_results(mgr: Any, results: Any, qname: str = "output") -> Any:
    """*DEPRECATED* in TFoS. Use TFNode.DataFeed class instead."""
    raise Exception("DEPRECATED: Use TFNode.DataFeed class instead")


def terminate(mgr: Any, qname: str = "input") -> Any:
    """*DEPRECATED* in TFoS. Use TFNode.DataFeed class instead."""
    raise Exception("DEPRECATED: Use TFNode.DataFeed class instead")
