"""main_fun bodies for tests/python/test_hostile.py (imported by node processes)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

import numpy as np


def feed_rounds_then_allreduce(args: Dict[str, Any], ctx: Any) -> None:
    """Serves ``args["rounds"]`` train() calls.  In the last one the first
    collective call is made after the first batch, so the communicator's mesh
    is built while that round runs (under attack in the test), and train()
    cannot end before it: the rest of the share is read after it.  Writes
    the ids of each round and the allreduce result."""
    feed = ctx.get_data_feed()
    rounds: List[Dict[str, Any]] = []
    for r in range(args["rounds"]):
        ids: List[int] = []
        reduced = None
        # At the end of a train() call next_batch returns nothing at once:
        # wait for the next call's data.
        batch = feed.next_batch(64)
        deadline = time.monotonic() + 300
        while len(batch) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
            batch = feed.next_batch(64)
        while len(batch) > 0:
            ids.extend(int(i) for i in batch.columns[0])
            if r == args["rounds"] - 1 and reduced is None:
                total = np.array([float(ctx.worker_num + 1)])
                ctx.allreduce(total, op="sum")
                reduced = float(total[0])
            if feed.should_stop():
                break
            batch = feed.next_batch(64)
        rounds.append({"ids": ids, "reduced": reduced})
    path = os.path.join(args["out"], f"node-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"index": ctx.worker_num, "rounds": rounds}, f)
    os.replace(path + ".tmp", path)
