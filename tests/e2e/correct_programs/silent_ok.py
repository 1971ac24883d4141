"""A correct DDP program for the checks of silent bugs (issue 13): no error or warning expected.

Existence checks done right (every rank looks for a checkpoint to resume from before any rank
writes one; after the save and a barrier every rank checks, lists and globs the folder), a
BatchNorm model under DDP (buffers broadcast from rank 0 each step), a checkpoint saved from rank 0,
intended per-rank augmentation from Python's `random` and NumPy seeded with the rank.
"""

import datetime
import glob
import os
import random
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-silent-ok-{os.environ['MASTER_PORT']}")
    ckpt = os.path.join(folder, "last.pt")
    resume = os.path.exists(ckpt)  # before anyone writes it: ordered by the barrier below
    dist.barrier()
    torch.manual_seed(0)
    random.seed(100 + rank)  # per-rank augmentation: meant to differ
    np.random.seed(200 + rank)
    data = TensorDataset(torch.randn(128, 6), torch.randn(128, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model = DDP(net)  # SyncBatchNorm needs GPU modules under DDP; per-rank BN stats, buffers broadcast
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            if random.random() < 0.5:  # per-rank augmentation
                x = x + float(np.random.normal(0, 0.01))
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "resumed": resume}, ckpt)
        dist.barrier()  # the checkpoint exists before anyone looks for it
        assert os.path.exists(ckpt) and glob.glob(os.path.join(folder, "*.pt")) and os.listdir(folder)
        state = torch.load(ckpt)
        assert state["epoch"] == epoch
        dist.barrier()  # everyone has read it before the next save
    if rank == 0:
        os.remove(ckpt)
        os.rmdir(folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
