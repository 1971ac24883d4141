"""rank-failed, bad: rank 1 raises on a corrupt sample while rank 0 waits in the step's all-reduce.

Rank 0 then fails too ("Connection closed by peer", or the launcher ends it): that failure is
collateral; the root cause is rank 1's ValueError.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/rank-failed/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def load_sample(rank: int, step: int) -> torch.Tensor:
    if rank == 1 and step == 2:
        raise ValueError(f"corrupt sample at step {step}")  # the root cause
    return torch.full((4,), float(step))


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    for step in range(4):
        x = load_sample(rank, step)
        dist.all_reduce(x)  # rank 0 waits here for rank 1, which has died
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
