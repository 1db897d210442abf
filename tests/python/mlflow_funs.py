"""main_fun bodies of test_mlflow.py (imported by node processes)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict


def train_epochs(args: Dict[str, Any], ctx: Any) -> None:
    """Two "epochs" whose metrics every node logs (only the chief's reach
    MLflow), then the chief "exports" a model and logs it as an artifact.
    With args["fail_once"], the chief fails on the first attempt, before
    logging anything (the driver restarts the cluster)."""
    if args.get("fail_once") and ctx.is_chief and os.environ.get("EMBER_RESTART") == "0":
        raise RuntimeError("injected failure of the chief on attempt 0")
    if args.get("fail_always") and ctx.is_chief:
        raise RuntimeError("injected failure of the chief, every attempt")
    for epoch in range(2):
        ctx.log_metrics({"loss": 1.0 / (epoch + 1), "node": float(ctx.worker_num)}, step=epoch)
    if ctx.is_chief:
        export = os.path.join(args["out"], "export")
        os.makedirs(export, exist_ok=True)
        with open(os.path.join(export, "model.json"), "w") as f:
            json.dump({"weights": [1, 2, 3], "run_id": ctx.mlflow_run_id}, f)
        ctx.log_artifacts(export, "model")


def yarn_epochs() -> Any:
    """run_on_yarn's experiment_fn: the chief logs two epochs through ctx and
    returns its numbers (logged by the client as ``chief_0.<key>``)."""
    def task(ctx: Any) -> Dict[str, Any]:
        for epoch in range(2):
            ctx.log_metrics({"accuracy": 0.5 + epoch / 10}, step=epoch)
        return {"final_accuracy": 0.6, "run_id": ctx.mlflow_run_id}
    return task
