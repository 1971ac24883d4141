"""uneven-inputs, bad: the data is split by hand, so rank 0 gets 5 batches and rank 1 gets 4.

Rank 0's fifth backward all-reduces gradients with a peer that has already left the loop: it
hangs until the backend's timeout (or fails when the peer exits).
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/uneven-inputs/bad.py

``bad.py early``: the same hang from early stopping on each rank's own loss: the ranks see
different losses, so one of them breaks out of the loop first (the report names the `break` and
its condition).
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if sys.argv[1:] == ["early"]:
        early_stopping(model, opt, rank)
        return
    data = torch.randn(9, 8)
    mine = data[rank::world]  # the bug: 9 samples over 2 ranks -> 5 and 4 batches
    for x in mine:
        opt.zero_grad()
        loss = model(x.unsqueeze(0)).pow(2).mean()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


def early_stopping(model, opt, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches, as with a sampler
    best, stale = float("inf"), 0
    for _epoch in range(50):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < best - 1e-3:  # the bug: this rank's own loss decides
            best, stale = loss.item(), 0
        else:
            stale += 1
        if stale >= 2:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
