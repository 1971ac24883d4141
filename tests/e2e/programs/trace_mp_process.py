"""A 2-rank gloo job of plain multiprocessing.Process children: rank 0 forked, rank 1 started
with the "spawn" method; rank 1 raises after its last collective (tests/test_trace_jobs.py).
The parent imports torch and never joins the process group.

Usage: trace_mp_process.py PORT
"""

import datetime
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist


def worker(rank: int, world: int, port: int) -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world, timeout=timeout)  # L:init
    t = torch.ones(2, 2)
    dist.all_reduce(t)  # L:all_reduce
    dist.barrier()  # L:barrier
    dist.destroy_process_group()  # L:destroy
    if rank == 1:
        raise KeyError("rank 1 fails after the job")  # L:raise


if __name__ == "__main__":
    port = int(sys.argv[1])
    torch.zeros(1)  # the parent uses torch before forking
    procs = [multiprocessing.get_context(m).Process(target=worker, args=(r, 2, port))
             for r, m in enumerate(("fork", "spawn"))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    sys.exit(max(p.exitcode if p.exitcode is not None else 99 for p in procs))
