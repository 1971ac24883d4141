"""collective-mismatch, good: agree on the size first, pad to it, then gather.

Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/collective-mismatch/good.py
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
    mine = len(range(rank, n_samples, world))
    scores = torch.rand(mine)
    size = torch.tensor([mine])
    dist.all_reduce(size, op=dist.ReduceOp.MAX)  # every rank learns the longest length
    padded = torch.zeros(int(size.item()))
    padded[:mine] = scores
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
