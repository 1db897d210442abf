"""main_fun for the HDFS Fashion-MNIST test (InputMode.TENSORFLOW): each node
reads its shard of TFRecords straight from HDFS (libember's WebHDFS reader),
trains with examples/fashion_mnist's MultiWorkerMirroredStrategy loop, and
the chief writes its checkpoints, SavedModel and a TensorBoard log back to
HDFS through ember.hdfs (TensorFlow itself has no hdfs:// without libhdfs:
it writes local directories that ember.hdfs.Mirror / upload copy over).

args: data_url, model_url, export_url, tb_url (hdfs:// URLs), epochs,
batch_size, learning_rate, steps_per_epoch, train_records, threads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any


def train_hdfs(args: Any, ctx: Any) -> None:
    from examples.fashion_mnist import model as m

    from ember import hdfs, tfrecord

    if m._not_a_trainer(ctx):
        return
    # inputs are checked before joining the cluster (a worker failing later
    # would leave the others waiting in a collective)
    files = tfrecord.list_files(args.data_url)
    tf = m._import_tf()
    strategy = m._make_strategy(tf, args)
    trainer = m._Trainer(tf, strategy, args)
    chief = m._is_chief(strategy)
    who = f"{ctx.job_name}:{ctx.task_index}"
    spe = int(args.steps_per_epoch or max(1, int(args.train_records) // trainer.global_batch))
    ds = (tfrecord.dataset(files, 1024, m._COLUMNS, shard=ctx, num_epochs=None,
                           shuffle_files=True, seed=ctx.worker_num)
          .map(lambda b: (b["image"], b["label"]))
          .unbatch()
          .shuffle(10000, seed=ctx.worker_num)
          .batch(int(args.batch_size), drop_remainder=True)
          .prefetch(tf.data.AUTOTUNE))
    it = iter(ds)

    # model_url mirrored locally: every worker restores from the chief's
    # checkpoints there; only the chief uploads.
    mirror = hdfs.Mirror(args.model_url)
    tmp = tempfile.mkdtemp(prefix="ember-hdfs-fmnist-")
    local = argparse.Namespace(**vars(args))
    local.model_dir = mirror.local
    local.export_dir = os.path.join(tmp, "export")
    try:
        step = trainer.restore(local)
        tb = tf.summary.create_file_writer(os.path.join(tmp, "tb")) if chief else None
        total = int(args.epochs) * spe
        t0 = time.time()
        loss_sum, loss_n = 0.0, 0
        while step < total:
            x, y = next(it)
            loss, _ = trainer.step(x, y)
            step += 1
            loss_sum += loss
            loss_n += 1
            if step % spe == 0:
                m._report(ctx, f"{who} epoch {step // spe} step {step} loss "
                               f"{loss_sum / loss_n:.4f} {time.time() - t0:.1f}s")
                if tb is not None:
                    with tb.as_default():
                        tf.summary.scalar("loss", loss_sum / loss_n, step=step)
                    tb.flush()
                loss_sum, loss_n = 0.0, 0
                if step < total:
                    trainer.checkpoint(local, chief, step)
                    if chief:
                        mirror.sync()
        ckpt, export = trainer.save(local, chief, step)
        if chief:
            mirror.sync()
            hdfs.upload(export, args.export_url)
            tb.close()
            hdfs.upload(os.path.join(tmp, "tb"), args.tb_url)
            m._report(ctx, f"{who} wrote {ckpt} -> {args.model_url}, SavedModel -> "
                           f"{args.export_url}, TensorBoard -> {args.tb_url}")
        del it, ds
        trainer.barrier()
    finally:
        mirror.close(upload_last=False)
        trainer.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
