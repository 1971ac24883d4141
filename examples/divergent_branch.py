"""A rank-divergent branch: rank 0 all-reduces a metric the other ranks never reduce.

Run: ddpdoctor trace --hang-timeout 5 --on-hang kill -- torchrun --nproc_per_node=2 examples/divergent_branch.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    x = torch.ones(4)
    for _step in range(3):
        dist.all_reduce(x)
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # the bug: only rank 0 reduces
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
