"""A rank-divergent branch: rank 0 all-reduces a metric that rank 1 never reduces, so the ranks'
sequences differ at collective #4 (tests/test_trace_jobs.py). Each rank's collective there
fails at the process-group timeout (EXAMPLE_PG_TIMEOUT). Run with torchrun --nproc_per_node=2."""

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
        dist.all_reduce(x)  # L:all_reduce
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # L:all_reduce:metric
    dist.barrier()  # L:barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
