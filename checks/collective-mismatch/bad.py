"""collective-mismatch, bad: each rank all-reduces a vector as long as its own number of
evaluation samples; the last shard is shorter on one rank. gloo aborts the process ("Received
data size doesn't match expected size", SIGABRT) or, for other sizes, waits forever.

Run: ddpdoctor trace --hang-timeout 5 --on-hang kill -- torchrun --nproc_per_node=2 checks/collective-mismatch/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    n_samples = 1999
    mine = len(range(rank, n_samples, world))  # 1000 on rank 0, 999 on rank 1
    scores = torch.rand(mine)
    dist.all_reduce(scores)  # the bug: sizes differ across ranks
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
