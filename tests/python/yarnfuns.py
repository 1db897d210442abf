"""Experiment functions for tests/python/test_yarn_run.py.

They live in a module of their own, not in the test file: cloudpickle pickles
functions of importable modules by reference, and the YARN containers import
this one (the tests pass ``PYTHONPATH`` through ``run_on_yarn(env=...)``).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from typing import Any, Callable, Dict

import numpy as np


def roles_and_allreduce() -> Callable[[Any], Dict[str, Any]]:
    """Each task: who it is, its cluster spec and TF_CONFIG, and an allreduce
    of its rank over the chief and workers (Ember's collective, across YARN
    containers)."""
    def task(ctx: Any) -> Dict[str, Any]:
        ranks = np.array([float(ctx.collective.rank)])
        ctx.allreduce(ranks)
        gathered = ctx.allgather(np.array([ctx.task_index], np.int64))
        secret = os.environ["EMBER_YARN_SECRET_FILE"]
        return {"job_name": ctx.job_name, "task_index": ctx.task_index,
                "rank": ctx.collective.rank, "size": ctx.collective.size,
                "cluster_spec": ctx.cluster_spec, "num_workers": ctx.num_workers,
                "tf_config": json.loads(os.environ["TF_CONFIG"]),
                "torch_env": {k: os.environ.get(k) for k in
                              ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
                "sum_of_ranks": float(ranks[0]), "gathered": gathered.ravel().tolist(),
                "secret_mode": stat.S_IMODE(os.stat(os.path.realpath(secret)).st_mode),
                "secret_len": os.path.getsize(secret),
                "env_has_secret_bytes": any(open(secret, "rb").read().hex() in v
                                            for v in os.environ.values()),
                "container": os.environ.get("CONTAINER_ID"), "host": socket.gethostname(),
                "attempt": int(os.environ["EMBER_YARN_ATTEMPT"]),
                "absolute_path": ctx.absolute_path("models/x")}
    return task


def fails_on_first_attempt() -> Callable[[Any], Dict[str, Any]]:
    """worker:0 raises on attempt 1; every task also reports what it got from
    ``files=`` and which Python (the packed environment's) started it."""
    def task(ctx: Any) -> Dict[str, Any]:
        attempt = int(os.environ["EMBER_YARN_ATTEMPT"])
        if ctx.job_name == "worker" and attempt == 1:
            raise RuntimeError(f"injected failure of worker:{ctx.task_index} on attempt 1")
        with open("notes.txt") as f:
            notes = f.read()
        with open(os.path.join("assets", "a.json")) as f:
            asset = json.load(f)
        return {"attempt": attempt, "notes": notes, "asset": asset,
                "pyenv_marker": os.environ.get("EMBER_TEST_PYENV"),
                "python": os.environ.get("EMBER_TEST_PYENV_ARGV0")}
    return task


def always_fails() -> Callable[[Any], Dict[str, Any]]:
    """worker:0 raises; the chief succeeds (so the worker is the only failure)."""
    def task(ctx: Any) -> Dict[str, Any]:
        if ctx.job_name == "worker":
            print(f"worker {ctx.task_index} about to fail", flush=True)
            raise ValueError("the worker's data is bad (injected)")
        return {}
    return task


def reads_tensorboard() -> Callable[[Any], Dict[str, Any]]:
    """The chief waits for the tensorboard task's URL and fetches its page."""
    def task(ctx: Any) -> Dict[str, Any]:
        import time
        import urllib.request

        from ember import hdfs

        where = os.environ["EMBER_YARN_STAGING"] + "/tensorboard.url"
        deadline = time.monotonic() + 240
        while not hdfs.exists(where):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {where} after 240 s")
            time.sleep(1)
        url = hdfs.read_bytes(where).decode()
        with urllib.request.urlopen(url + "/data/logdir", timeout=60) as r:
            return {"url": url, "status": r.status, "logdir": json.load(r)}
    return task


def keras_fails_once(model_dir: str, epochs: int) -> Any:
    """Y2's Keras Fashion-MNIST experiment (yarn_experiment_fns.keras_fmnist)
    whose worker:0 raises at the end of epoch 1 on attempt 1 (after the chief
    has checkpointed epoch 1): attempt 2 must resume from that checkpoint."""
    import keras

    import yarn_experiment_fns

    exp = yarn_experiment_fns.keras_fmnist(model_dir, epochs=epochs)

    class FailOnce(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if (epoch == 0 and os.environ.get("EMBER_YARN_ATTEMPT") == "1"
                    and os.environ.get("EMBER_YARN_TASK") == "worker:0"):
                # fail once the chief's checkpoint of epoch 1 is in model_dir:
                # failing at once races the AM's stop of the chief against
                # its upload, and the retry would rightly start from epoch 0
                import re
                import time

                from ember import hdfs

                deadline = time.monotonic() + 300
                while not any(re.fullmatch(r"ckpt-0*1\.keras", n)
                              for n in (hdfs.listdir(model_dir) if hdfs.exists(model_dir)
                                        else [])):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no checkpoint of epoch 1 in {model_dir}")
                    time.sleep(0.5)
                raise RuntimeError("injected: worker:0 fails after epoch 1 on attempt 1")

    return exp._replace(train_params=dict(exp.train_params, callbacks=[FailOnce()]))


def hangs() -> Callable[[Any], Dict[str, Any]]:
    def task(ctx: Any) -> Dict[str, Any]:
        import time
        time.sleep(3600)
        return {}
    return task


def plain_value() -> Dict[str, Any]:
    """Not a callable experiment: run_task would be needed (and is not asked here)."""
    return {"not": "callable"}


if __name__ == "__main__":
    sys.exit("helper module for tests/python/test_yarn_run.py")
