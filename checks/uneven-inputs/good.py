"""uneven-inputs, good: the same uneven split, trained inside ``Join``.

``Join`` lets the rank that runs out of batches shadow the others' gradient all-reduces, so the
ranks finish together. (Alternatives: ``DistributedSampler`` pads to equal length;
``drop_last=True`` drops the remainder.)
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/uneven-inputs/good.py

``good.py early``: early stopping decided on the loss averaged over the ranks (one all-reduce per
epoch): every rank sees the same value and leaves the loop at the same step.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if sys.argv[1:] == ["early"]:
        early_stopping(model, opt, rank, world)
        return
    data = torch.randn(9, 8)
    mine = data[rank::world]  # 5 and 4 batches, as in bad.py
    with Join([model]):
        for x in mine:
            opt.zero_grad()
            loss = model(x.unsqueeze(0)).pow(2).mean()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


def early_stopping(model, opt, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches, as with a sampler
    best, stale = float("inf"), 0
    for _epoch in range(50):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the same value on every rank decides
        mean = mean.item() / world
        if mean < best - 1e-3:
            best, stale = mean, 0
        else:
            stale += 1
        if stale >= 2:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
