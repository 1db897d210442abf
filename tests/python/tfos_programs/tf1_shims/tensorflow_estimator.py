"""Test-only stand-in for the two TF 2.0-era calls at the end of TFoS's
mnist_spark.py that today's TensorFlow no longer has: ``tensorflow_estimator``
(gone since TF 2.16) for ``export_lib.get_timestamped_export_dir``, and
``tf.keras.experimental.export_saved_model`` (gone from tf_keras), which it
installs as the SavedModel of a plain copy of the model.

On the PYTHONPATH of test_compat_tfos's run of that example only; it lets the
example run unchanged but for its imports.
"""

import os
import sys
import time
import types


def get_timestamped_export_dir(export_dir_base):
    """export_lib's: ``<base>/<seconds since the epoch>``, a fresh one."""
    while True:
        path = os.path.join(export_dir_base, str(int(time.time())))
        if not os.path.exists(path):
            return path
        time.sleep(1)


def _export_saved_model(model, export_dir):
    """TF 2.0's export from the chief alone.  Today's ``model.save`` of a
    MultiWorkerMirroredStrategy model needs every worker in it (the example's
    worker does not export), so this saves a copy without the strategy."""
    import tensorflow as tf

    copy = tf.keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    copy.save(export_dir, save_format="tf")


def _install():
    names = ["python", "python.estimator", "python.estimator.export"]
    parent = sys.modules[__name__]
    parent.__path__ = []  # a package, for the import system
    for name in names:
        module = types.ModuleType(f"{__name__}.{name}")
        module.__path__ = []
        sys.modules[module.__name__] = module
        setattr(parent, name.rsplit(".", 1)[-1], module)
        parent = module
    export_lib = types.ModuleType(f"{__name__}.python.estimator.export.export_lib")
    export_lib.get_timestamped_export_dir = get_timestamped_export_dir
    sys.modules[export_lib.__name__] = export_lib
    parent.export_lib = export_lib
    # the example calls tf.keras.experimental.export_saved_model right after this import
    import tensorflow as tf

    if not hasattr(tf.keras.experimental, "export_saved_model"):
        tf.keras.experimental.export_saved_model = _export_saved_model


_install()
