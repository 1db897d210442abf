"""TensorFlowOnSpark's ``compat`` helpers (TensorFlow version shims) on Ember.

``export_saved_model(model, export_dir, is_chief)`` differs from TFoS on one
point: a non-chief worker saves to a private temporary directory (removed
afterwards) instead of the shared relative path ``worker_model``, so workers
on one host or one shared filesystem never collide.  An ``hdfs://`` (or
``webhdfs://``) export_dir, which TensorFlow cannot write without libhdfs, is
saved locally and uploaded with :func:`ember.hdfs.upload` (renamed into
place, so readers never see half a model).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from ember import hdfs


def export_saved_model(model: Any, export_dir: str, is_chief: bool = False) -> None:
    """Saves ``model`` as a SavedModel at ``export_dir`` on the chief.

    Every worker must call it (saving runs collectives under
    MultiWorkerMirroredStrategy); non-chief workers write to a private temp dir,
    and so does the chief when export_dir is on HDFS, uploading it there."""
    if is_chief and not hdfs.is_hdfs(export_dir):
        _save(model, export_dir)
        return
    tmp = tempfile.mkdtemp(prefix="ember-worker-model-")
    try:
        _save(model, tmp)
        if is_chief:
            hdfs.upload(tmp, export_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(model: Any, path: str) -> None:
    import tensorflow as tf

    if type(model).__module__.startswith("tf_keras") or not hasattr(model, "export"):
        if hasattr(model, "save"):
            model.save(path, save_format="tf")  # tf_keras (TF_USE_LEGACY_KERAS=1), TFoS's call
        else:
            tf.saved_model.save(model, path)
    else:
        model.export(path)  # Keras 3: model.save() no longer writes a SavedModel


def disable_auto_shard(options: Any) -> None:
    """Turns off tf.data auto-sharding in ``options`` (a ``tf.data.Options``)."""
    import tensorflow as tf

    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF


def is_gpu_available() -> bool:
    """True when TensorFlow sees at least one GPU."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU")) > 0
