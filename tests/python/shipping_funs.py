"""Functions run on executors and YARN containers that have no Ember of their
own: test_packaging.py ships Ember to them in a packed environment.  These
functions are pickled by value (cloudpickle.register_pickle_by_value), since
the executors cannot import the tests' modules either."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict


def where_ember_comes_from() -> Dict[str, Any]:
    import ember
    from ember import _ember

    return {"ember_file": ember.__file__, "extension_file": _ember.__file__,
            "version": ember.__version__, "python": sys.executable,
            "sys_prefix": sys.prefix, "cwd": os.getcwd()}


def count_and_report(args: Dict[str, Any], ctx: Any) -> None:
    """A node: consumes the feed and writes where its Ember came from."""
    feed = ctx.get_data_feed()
    n = total = 0
    while not feed.should_stop():
        batch = feed.next_batch(64)
        if len(batch) == 0:
            break
        n += len(batch)
        total += sum(int(i) for i in batch.columns[0])
    info = dict(where_ember_comes_from(), node=ctx.worker_num, executor_id=ctx.executor_id,
                records=n, id_sum=total)
    path = os.path.join(args["out"], f"node-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def yarn_experiment() -> Callable[[Any], Dict[str, Any]]:
    """run_on_yarn's experiment_fn: each task allreduces its rank and says
    where its Ember came from."""
    def task(ctx: Any) -> Dict[str, Any]:
        import numpy as np

        ranks = np.array([float(ctx.collective.rank)])
        ctx.allreduce(ranks)
        return dict(where_ember_comes_from(), rank=ctx.collective.rank,
                    sum_of_ranks=float(ranks[0]))
    return task
