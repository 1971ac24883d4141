"""batchnorm-sync, good: SyncBatchNorm conversion before DDP wrapping (where DDP supports it: GPU
modules); on CPU, plain BatchNorm over a per-rank batch large enough for stable statistics.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/batchnorm-sync/good.py
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
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda()  # before wrapping
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(64, 8, generator=g)  # 64 samples per rank: stable per-rank statistics
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
