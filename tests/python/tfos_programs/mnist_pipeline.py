"""A TFEstimator ``train_fn`` written the way TensorFlowOnSpark's pipeline example
(examples/mnist/keras/mnist_pipeline.py) is: TF 2 Keras calls that Keras 3
rejects (a ModelCheckpoint of weights to ``weights-{epoch:04d}``, without
Keras 3's ``.weights.h5``; MultiWorkerMirroredStrategy), train() data read
through an inference-mode feed, and no TF_USE_LEGACY_KERAS of its own (unlike
mnist_keras.py): ``TFEstimator.fit`` must start its nodes with tf_keras, as
``TFCluster.run`` does.  It records which Keras it ran on.
"""

import json
import os


def train_fn(args, ctx):
    import numpy as np
    import tensorflow as tf
    from ember.compat.tfos import TFNode, compat

    strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input(shape=(784,), name="image"),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax", name="prediction"),
        ])
        model.compile(loss=tf.keras.losses.sparse_categorical_crossentropy,
                      optimizer=tf.keras.optimizers.Adam(learning_rate=2e-3),
                      metrics=["accuracy"])

    feed = TFNode.DataFeed(ctx.mgr, False)  # as the example: train() data, inference mode

    def records():
        while not feed.should_stop():
            batch = feed.next_batch(1)
            if len(batch) == 0:
                return
            image, label = batch[0]
            yield np.asarray(image, np.float32), np.asarray([label], np.float32)

    ds = tf.data.Dataset.from_generator(
        records, (tf.float32, tf.float32), (tf.TensorShape([784]), tf.TensorShape([1])))
    ds = ds.batch(args.batch_size)
    tf.io.gfile.makedirs(args.model_dir)
    checkpoint = tf.keras.callbacks.ModelCheckpoint(
        filepath=args.model_dir + "/weights-{epoch:04d}", save_weights_only=True)
    model.fit(ds, epochs=args.epochs, steps_per_epoch=args.train_records // args.batch_size,
              callbacks=[checkpoint], verbose=0)
    compat.export_saved_model(model, args.export_dir, ctx.job_name == "chief")
    feed.terminate()
    with open(os.path.join(args.model_dir, f"keras-{ctx.worker_num}.json"), "w") as f:
        json.dump({"keras": type(model).__module__,
                   "TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS")}, f)
