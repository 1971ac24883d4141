"""A correct 2-rank job with every kind of event the timeline draws: collectives, an async
all_reduce and its wait, p2p send/recv, a DDP step, and a late rank whose peer waits for it.

Run: torchrun --nproc_per_node=2 tests/e2e/programs/timeline_mixed_ops.py
"""

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

#: How long rank 1 dawdles before the last all_reduce (rank 0 waits that long inside it).
LATE_S = float(os.environ.get("TIMELINE_LATE_S", "0.4"))


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.ones(8)
    dist.all_reduce(x)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    if rank == 0:
        dist.send(torch.ones(3), dst=1)
    else:
        buf = torch.empty(3)
        dist.recv(buf, src=0)
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(5, 4)).sum().backward()
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    dist.all_reduce(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
