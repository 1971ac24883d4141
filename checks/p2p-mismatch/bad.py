"""p2p-mismatch, bad: rank 0 streams 3 chunks to rank 1, but rank 1 expects only 2.

Rank 0's third ``send`` is never received: it blocks until the backend's timeout while rank 1
has moved on to the barrier.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/p2p-mismatch/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist

CHUNKS = 3


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    if rank == 0:
        for i in range(CHUNKS):
            dist.send(torch.full((4,), float(i)), dst=1)
    else:
        for _ in range(CHUNKS - 1):  # the bug: an off-by-one on the receiving side
            buf = torch.empty(4)
            dist.recv(buf, src=0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
