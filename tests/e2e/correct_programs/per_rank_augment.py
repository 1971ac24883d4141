"""Correct: Python and NumPy randomness seeded per rank on purpose, for augmentation only.

The set-up draws nothing from the global generators that must agree: the file list is shuffled by
a generator of its own with a shared seed, each rank then shuffles its own shard (a different list
per rank), and the model comes from a shared torch seed. The training loop, which has no
DataLoader, draws its augmentation (a random flip, a random choice of transform, NumPy noise)
before each forward, the first one included. Expected: no error, no warning (the rank-dependent
seeds are info at most).
"""

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    random.seed(1000 + rank)  # per-rank augmentation: meant to differ
    np.random.seed(rank)
    noise = np.random.default_rng(7 + rank)  # per-rank noise generator
    files = [f"shard-{i:03d}.bin" for i in range(16)]
    random.Random(42).shuffle(files)  # a shared order: its own generator, the same seed everywhere
    mine = files[rank::world]
    random.shuffle(mine)  # each rank shuffles its own shard: intended
    model = DDP(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    flips = [lambda t: t, lambda t: t.flip(1)]
    data = torch.randn(64, 6)
    target = torch.randn(64, 1)
    for step in range(6):
        x = data[step * 8:(step + 1) * 8]
        if random.random() < 0.5:
            x = x * 1.01
        x = random.choice(flips)(x)
        x = x + torch.from_numpy(np.random.normal(0, 0.01, x.shape) + noise.normal(0, 0.01, x.shape)).float()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), target[step * 8:(step + 1) * 8]).backward()
        opt.step()
    print(f"rank {rank}: {len(mine)} files, first {mine[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
