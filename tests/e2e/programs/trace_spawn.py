"""A 2-rank gloo job started with torch.multiprocessing.spawn; rank 1 raises after its last
collective, so the job exits 1 (tests/test_trace_jobs.py).

Usage: trace_spawn.py PORT
"""

import datetime
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)  # L:init
    t = torch.ones(3)
    dist.all_reduce(t)  # L:all_reduce
    dist.broadcast(t, src=0)  # L:broadcast
    dist.barrier()  # L:barrier
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())  # L:all_gather_object
    dist.destroy_process_group()  # L:destroy
    if rank == 1:
        # mp.spawn terminates the other workers once one fails: let rank 0 end first.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        raise ValueError("rank 1 fails after the job")  # L:raise


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(sys.argv[1])), nprocs=2)
