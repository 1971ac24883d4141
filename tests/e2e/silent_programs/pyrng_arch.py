"""A hidden size picked with Python's `random`, seeded with the rank: each rank builds another model.

DDP's construction compares the parameter shapes across ranks and fails; the root cause is the
`random.choice` line and the rank-dependent `random.seed` before it.
"""

import datetime
import os
import random

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    random.seed(rank)
    hidden = random.choice([8, 16, 32, 64])  # the bug: 64 on rank 0, 16 on rank 1
    model = DDP(nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1)))
    print(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
