"""Rank 1 is SIGKILLed after three all-reduces; rank 0's next collective then fails
(tests/test_trace_jobs.py). Run with torchrun --nproc_per_node=2."""

import datetime
import os
import signal

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    t = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(t)  # L:all_reduce
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # L:kill
    dist.all_reduce(t)  # L:all_reduce:after
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
