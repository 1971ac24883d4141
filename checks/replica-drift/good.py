"""replica-drift, good: the layer is re-initialised before DDP wrapping, so DDP's initial broadcast
gives every rank rank 0's values, and from then on only the optimizer changes them.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/replica-drift/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        net[2].weight.normal_(0, 0.02)  # before wrapping: DDP broadcasts the result
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(5):
        x = torch.randn(32, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
