"""p2p-mismatch, good: every send has its recv, same order and shape; a ring exchange with
``batch_isend_irecv`` and a blocking send/recv pair.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/p2p-mismatch/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist

CHUNKS = 3


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for i in range(CHUNKS):
            dist.send(torch.full((4,), float(i)), dst=1)
    else:
        for _ in range(CHUNKS):
            buf = torch.empty(4)
            dist.recv(buf, src=0)
    out, inp = torch.full((3,), float(rank)), torch.empty(3)
    ops = [dist.P2POp(dist.isend, out, (rank + 1) % world),
           dist.P2POp(dist.irecv, inp, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
