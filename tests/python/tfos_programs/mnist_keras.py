"""Fashion-MNIST with tf.keras in TensorFlowOnSpark's style (its examples/mnist/keras:
mnist_spark.py, mnist_tf.py, mnist_inference.py), imports changed to ember.compat.tfos.

Keras 3 does not run under MultiWorkerMirroredStrategy, so these programs use the
TF 2 Keras (tf_keras) through TF_USE_LEGACY_KERAS=1, set before TensorFlow loads.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build_and_compile_model(tf, learning_rate):
    model = tf.keras.Sequential([
        tf.keras.layers.Flatten(input_shape=(28, 28, 1)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(loss=tf.keras.losses.sparse_categorical_crossentropy,
                  optimizer=tf.keras.optimizers.Adam(learning_rate=learning_rate),
                  metrics=["accuracy"])
    return model


def main_fun(args, ctx):
    """InputMode.SPARK (TFoS's mnist_spark.py): records (pixels, label) from the feed."""
    import numpy as np
    import tensorflow as tf
    from ember.compat.tfos import TFNode, compat

    strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()

    # TFoS's example reads train() data with train_mode=False
    tf_feed = TFNode.DataFeed(ctx.mgr, False)

    def rdd_generator():
        while not tf_feed.should_stop():
            batch = tf_feed.next_batch(1)
            if len(batch) > 0:
                example = batch[0]
                image = np.array(example[0]).astype(np.float32) / 255.0
                image = np.reshape(image, (28, 28, 1))
                label = np.array(example[1]).astype(np.float32)
                label = np.reshape(label, (1,))
                yield (image, label)
            else:
                return

    ds = tf.data.Dataset.from_generator(rdd_generator, (tf.float32, tf.float32),
                                        (tf.TensorShape([28, 28, 1]), tf.TensorShape([1])))
    options = tf.data.Options()
    compat.disable_auto_shard(options)
    ds = ds.with_options(options).batch(args.batch_size)

    tf.io.gfile.makedirs(args.model_dir)
    with strategy.scope():
        model = build_and_compile_model(tf, args.learning_rate)

    # as TFoS's example: stop at 90% of the expected steps per worker
    steps_per_epoch = args.train_records / args.batch_size
    max_steps_per_worker = int(steps_per_epoch / ctx.num_workers * 0.9)
    model.fit(x=ds, epochs=args.epochs, steps_per_epoch=max_steps_per_worker, verbose=0)

    compat.export_saved_model(model, args.export_dir, ctx.job_name == "chief")
    # terminating feed tells spark to skip processing further partitions
    tf_feed.terminate()


def main_fun_tf(args, ctx):
    """InputMode.TENSORFLOW (TFoS's mnist_tf.py over TFRecords): each worker reads its
    shard of the files written by dfutil.saveAsTFRecords."""
    import tensorflow as tf
    from ember.compat.tfos import compat

    strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()

    def parse(serialized):
        feats = tf.io.parse_single_example(serialized, {
            "image": tf.io.FixedLenFeature([784], tf.int64),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        image = tf.reshape(tf.cast(feats["image"], tf.float32) / 255.0, (28, 28, 1))
        return image, feats["label"]

    files = tf.io.gfile.glob(ctx.absolute_path(args.images_labels) + "/part-*")
    ds = tf.data.Dataset.from_tensor_slices(sorted(files))
    # this worker's rank among the trainers: the chief first, then the workers
    rank = ctx.task_index + (1 if ctx.job_name == "worker" and "chief" in ctx.cluster_spec else 0)
    ds = ds.shard(ctx.num_workers, rank)
    ds = ds.interleave(tf.data.TFRecordDataset).map(parse).repeat().batch(args.batch_size)
    options = tf.data.Options()
    compat.disable_auto_shard(options)
    ds = ds.with_options(options)

    with strategy.scope():
        model = build_and_compile_model(tf, args.learning_rate)
    steps = int(args.train_records / args.batch_size / ctx.num_workers)
    model.fit(x=ds, epochs=args.epochs, steps_per_epoch=steps, verbose=0)
    compat.export_saved_model(model, args.export_dir, ctx.job_name == "chief")


def inference(args, ctx):
    """InputMode.SPARK inference (cluster.inference): (label, prediction) per record."""
    import numpy as np
    import tensorflow as tf
    from ember.compat.tfos import TFNode

    model = tf.keras.models.load_model(args.export_dir)
    tf_feed = TFNode.DataFeed(ctx.mgr, False)
    while not tf_feed.should_stop():
        batch = tf_feed.next_batch(args.batch_size)
        if len(batch) == 0:
            break
        images = np.array([np.array(r[0]) for r in batch], dtype=np.float32) / 255.0
        labels = [int(r[1]) for r in batch]
        preds = np.argmax(model.predict(images.reshape(-1, 28, 28, 1), verbose=0), axis=1)
        tf_feed.batch_results([(lab, int(p)) for lab, p in zip(labels, preds)])


def parallel_inference(args, ctx):
    """TFParallel (TFoS's keras/mnist_inference.py): each instance predicts its share
    of the TFRecord files and writes "label prediction" lines."""
    import numpy as np
    import tensorflow as tf

    files = sorted(tf.io.gfile.glob(ctx.absolute_path(args.images_labels) + "/part-*"))
    mine = files[ctx.worker_num::ctx.num_workers]
    model = tf.keras.models.load_model(args.export_dir)

    def parse(serialized):
        feats = tf.io.parse_single_example(serialized, {
            "image": tf.io.FixedLenFeature([784], tf.int64),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        return tf.reshape(tf.cast(feats["image"], tf.float32) / 255.0, (28, 28, 1)), feats["label"]

    tf.io.gfile.makedirs(args.output)
    with open(os.path.join(args.output, "part-%05d" % ctx.worker_num), "w") as out:
        if mine:
            for images, labels in tf.data.TFRecordDataset(mine).map(parse).batch(256):
                preds = np.argmax(model.predict(images, verbose=0), axis=1)
                for lab, p in zip(labels.numpy(), preds):
                    out.write("%d %d\n" % (lab, p))


def pipeline_train_fn(args, ctx):
    """TFoS's pipeline example (keras/mnist_pipeline.py): TFEstimator's train_fn reads
    the InputMapping's tensors from the feed and exports a SavedModel on the chief."""
    import numpy as np
    import tensorflow as tf
    from ember.compat.tfos import TFNode, compat

    strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input(shape=(784,), name="image"),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax", name="prediction"),
        ])
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=tf.keras.optimizers.Adam(learning_rate=2e-3),
                      metrics=["accuracy"])

    tf_feed = TFNode.DataFeed(ctx.mgr, True, input_mapping=args.input_mapping)
    images, labels = [], []
    while not tf_feed.should_stop():
        batch = tf_feed.next_batch(args.batch_size)
        if len(batch["image"]) == 0:
            break
        images.append(np.asarray(batch["image"], dtype=np.float32))
        labels.append(np.asarray(batch["label"], dtype=np.int64))
    x, y = np.concatenate(images), np.concatenate(labels)
    model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0)
    compat.export_saved_model(model, args.export_dir, ctx.job_name == "chief")
