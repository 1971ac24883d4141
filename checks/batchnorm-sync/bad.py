"""batchnorm-sync, bad: the model is converted to SyncBatchNorm after it was wrapped in DDP.

DDP records the module's layers, parameters and buffers when it is constructed; converting
afterwards swaps the BatchNorm layers under it (the PyTorch docs: convert before wrapping). On
CPU/gloo the converted layers then fail in the first training forward; on GPUs the job runs with
DDP's buffer and bucket bookkeeping pointing at the old layers.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/batchnorm-sync/bad.py
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
    model = DDP(net)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the bug: after wrapping
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(64, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
