"""main_fun bodies for the PyTorch tests (run by the nodes)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List


def _train(model: Any, opt: Any, rank: int, steps: int = 6) -> List[float]:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        x = torch.randn(32, 40, generator=gen)
        y = torch.randint(0, 5, (32,), generator=gen)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def ddp_paths(args: Dict[str, Any], ctx: Any) -> None:
    """The same training three ways: DDP over gloo, DDP with Ember's comm hook,
    and ember.torch.DistributedOptimizer without torch.distributed."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ember.torch

    torch.set_num_threads(1)
    ember.torch.init_process_group(ctx, timeout=120)
    rank = dist.get_rank()
    out: Dict[str, Any] = dict(rank=rank, coll_rank=ctx.collective.rank,
                               world=dist.get_world_size())
    # 1. plain DDP (gloo); DDP broadcasts rank 0's initial weights itself
    ddp = DDP(_model(seed=rank))
    out["gloo"] = _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank)
    # 2. DDP with its gradient buckets averaged by Ember
    ddp = DDP(_model(seed=rank))
    ddp.register_comm_hook(ctx.collective, ember.torch.allreduce_hook)
    out["hook"] = _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank)
    # 3. no torch.distributed: broadcast + DistributedOptimizer
    model = _model(seed=rank)
    ember.torch.broadcast_parameters(model, ctx)
    opt = ember.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ctx)
    out["ember_opt"] = _train(model, opt, rank)
    out["opt_class"] = type(opt).__name__
    # 0-d tensors (BatchNorm's num_batches_tracked) broadcast with their shape
    bn = torch.nn.BatchNorm1d(3)
    bn.num_batches_tracked.fill_(7 + rank)
    ember.torch.broadcast_parameters(bn.state_dict(), ctx)
    out["bn_tracked"] = int(bn.num_batches_tracked)
    try:  # a scheduler attached first would bypass the wrapper: refused
        plain = torch.optim.SGD(_model(0).parameters(), lr=0.1)
        torch.optim.lr_scheduler.StepLR(plain, 1)
        ember.torch.DistributedOptimizer(plain, ctx)
        out["scheduler_error"] = ""
    except ValueError as exc:
        out["scheduler_error"] = str(exc)
    dist.destroy_process_group()
    path = os.path.join(args["out"], f"torch-{rank}.json")
    with open(path, "w") as f:
        json.dump(out, f)
