"""replica-drift, bad: rank 0 re-initialises a layer after DDP has broadcast the parameters.

DDP copies rank 0's parameters to every rank once, at construction. Anything that changes them
afterwards on some ranks only (a custom init, a checkpoint loaded on rank 0, a `.data` edit) leaves
the ranks with different models; every collective still matches, the gradients are averaged, the
job finishes, and each rank has trained its own model.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/replica-drift/bad.py
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
    model = DDP(net)
    if rank == 0:
        with torch.no_grad():
            net[2].weight.normal_(0, 0.02)  # the bug: after DDP's broadcast, on rank 0 only
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
