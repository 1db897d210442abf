"""Small TFoS-style map_funs that record what their DataFeed delivered."""

import json
import os


def _write(args, ctx, **info):
    info.update(executor_id=ctx.executor_id, worker_num=ctx.worker_num, job_name=ctx.job_name,
                task_index=ctx.task_index, cluster_spec=ctx.cluster_spec,
                num_workers=ctx.num_workers, defaultFS=ctx.defaultFS,
                working_dir=ctx.working_dir, tf_config=os.environ.get("TF_CONFIG"),
                absolute=ctx.absolute_path("model"))
    path = os.path.join(args["out"], "node-%d.json" % ctx.executor_id)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def roles(args, ctx):
    """Reports the node's identity (no feed)."""
    _write(args, ctx)


def count_feed(args, ctx):
    """TFoS's loop: reads until should_stop(); train_mode as args say (TFoS's keras
    example reads train() data with train_mode=False)."""
    from ember.compat.tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, args.get("train_mode", True))
    ids = []
    while not feed.should_stop():
        batch = feed.next_batch(args.get("batch", 10))
        if len(batch) == 0:
            break
        ids.extend(int(rec[0]) for rec in batch)
    _write(args, ctx, ids=ids)


def train_and_eval_feeds(args, ctx):
    """Reads the training feed to its end, then the 'eval' feed to its end."""
    train = ctx.get_data_feed(train_mode=True)
    ev = ctx.get_data_feed(train_mode=True, qname_in="eval")
    got = {}
    for name, feed in (("train", train), ("eval", ev)):
        ids = []
        while not feed.should_stop():
            batch = feed.next_batch(16)
            if len(batch) == 0:
                break
            ids.extend(int(i) for i in batch.columns[0])
        got[name] = ids
    _write(args, ctx, **got)


def square(args, ctx):
    """Inference: one result per record, TFoS style (lists of tuples)."""
    from ember.compat.tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    while not feed.should_stop():
        batch = feed.next_batch(7)
        if len(batch) == 0:
            break
        feed.batch_results([(int(rec[0]), int(rec[0]) ** 2) for rec in batch])


def mapped(args, ctx):
    """input_mapping: next_batch returns {tensor: column}."""
    from ember.compat.tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False, input_mapping={"a": "x", "b": "y"})
    while not feed.should_stop():
        batch = feed.next_batch(5)
        if not len(batch["x"]):
            break
        feed.batch_results([int(a) + int(b) for a, b in zip(batch["x"], batch["y"])])


def streaming_count(args, ctx):
    """TFoS's streaming loop with next_batch(1): reads across micro-batches until shutdown."""
    from ember.compat.tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    ids = []
    while not feed.should_stop():
        batch = feed.next_batch(1)
        if len(batch) == 0:
            break
        ids.append(int(batch[0][0]))
        if len(ids) >= args["stop_after"]:
            break
    feed.terminate()
    _write(args, ctx, ids=ids)


def worker_dies_while_chief_sleeps(args, ctx):
    """The chief reads its feed only after ``args["chief_sleep"]`` s; the worker
    raises after ``args["worker_sleep"]`` s, before it ever reads."""
    import time

    from ember.compat.tfos import TFNode

    if ctx.job_name == "worker":
        time.sleep(args["worker_sleep"])
        raise ValueError("worker gave up before reading its feed")
    time.sleep(args["chief_sleep"])
    feed = TFNode.DataFeed(ctx.mgr, True)
    while not feed.should_stop():
        if len(feed.next_batch(10)) == 0:
            break
