"""uneven-inputs, bad: the data is split by hand, so rank 0 gets 5 batches and rank 1 gets 4.

Rank 0's fifth backward all-reduces gradients with a peer that has already left the loop: it
hangs until the backend's timeout (or fails when the peer exits).
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/uneven-inputs/bad.py
"""

import datetime
import os

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
    data = torch.randn(9, 8)
    mine = data[rank::world]  # the bug: 9 samples over 2 ranks -> 5 and 4 batches
    for x in mine:
        opt.zero_grad()
        loss = model(x.unsqueeze(0)).pow(2).mean()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
