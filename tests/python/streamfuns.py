"""main_fun bodies and helpers of the stream-training tests (test_stream.py,
test_cluster.py's stream job): imported by node processes."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List


def _save(path: str, state: Dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def checkpointed_ids(args: Dict[str, Any], ctx: Any) -> None:
    """A trainer whose model is the list of record ids it trained on.

    It resumes from its checkpoint (``ckpt-<index>.json``: the ids and the
    stream's next micro-batch), reads the stream micro-batch by micro-batch
    (``args["step"]`` s per batch of ``args["batch"]``; ``args["slow"]``, a
    micro-batch id and a step, slows that one in the node's first run, so a
    test can act in its middle), checkpoints after
    every ``args["every"]``-th micro-batch and, unless the feed ended in the
    middle of one, at the end.  ``live-<index>.json`` says how far this run
    is: its pid, the micro-batch being read, the records read of it, the
    micro-batches read whole."""
    out, me = args["out"], ctx.worker_num
    path = os.path.join(out, f"ckpt-{me}.json")
    state = json.load(open(path)) if os.path.exists(path) else {"ids": [], "next": 0}
    ctx.resume_from(state["next"])
    feed = ctx.get_data_feed()
    ids: List[int] = list(state["ids"])
    done: List[int] = []
    live = os.path.join(out, f"live-{me}.json")
    restart = int(os.environ.get("EMBER_RESTART", "0"))
    column, every = args.get("column", "id"), args.get("every", 2)
    slow_micro_batch, slow_step = args.get("slow", (None, 0)) if restart == 0 else (None, 0)

    def progress(micro_batch: Any, read: int) -> None:
        _save(live, dict(pid=os.getpid(), restart=restart, micro_batch=micro_batch, read=read,
                         done=done, start=state["next"]))

    progress(None, 0)
    for micro_batch in feed.micro_batches():
        read = 0
        while not feed.should_stop():
            batch = feed.next_batch(args.get("batch", 50))
            if len(batch):
                ids.extend(int(v) for v in batch.column(column))
            read += len(batch)
            # the training step
            time.sleep(slow_step if micro_batch == slow_micro_batch else args.get("step", 0))
            progress(micro_batch, read)
        if feed.mid_micro_batch:
            break  # the feed ended in the middle of this micro-batch
        done.append(micro_batch)
        progress(micro_batch, read)
        if (micro_batch + 1) % every == 0:
            _save(path, {"ids": ids, "next": feed.next_micro_batch})
            ctx.checkpointed(feed.next_micro_batch)
    if not feed.mid_micro_batch and feed.next_micro_batch is not None:
        _save(path, {"ids": ids, "next": feed.next_micro_batch})


def trained_ids(out: str, nodes: int) -> List[int]:
    """Every id the nodes' last checkpoints hold, with repeats."""
    ids: List[int] = []
    for i in range(nodes):
        with open(os.path.join(out, f"ckpt-{i}.json")) as f:
            ids.extend(json.load(f)["ids"])
    return ids


def live(out: str, node: int) -> Dict[str, Any]:
    """What node ``node``'s run said last (empty before it said anything)."""
    try:
        with open(os.path.join(out, f"live-{node}.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def wait_for(what: str, check: Any, timeout: float = 120.0) -> Any:
    """Polls ``check()`` until it returns something true; raises after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def write_id_files(directory: str, files: int, per_file: int, first: int = 0) -> int:
    """``files`` JSON-lines files of ``per_file`` records {"id": n} each, ids
    counting from ``first``, written whole then renamed in (as a file
    stream's source needs); returns the next id."""
    os.makedirs(directory, exist_ok=True)
    n = first
    for f in range(files):
        tmp = os.path.join(directory, f".part-{n}.tmp")
        with open(tmp, "w") as out:
            for _ in range(per_file):
                out.write(json.dumps({"id": n}) + "\n")
                n += 1
        os.replace(tmp, os.path.join(directory, f"part-{first + f * per_file:08d}.json"))
    return n
