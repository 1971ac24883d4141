"""Fault-matrix program: the store's host (rank 0, env:// initialisation through
multiprocessing) leaves right after destroy_process_group while rank 1 lives on for 4 s
(argv[2] "quick": no lingering; the ``python -I`` cell's small distributed program)."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def rank_main(rank, port, linger):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    t = torch.ones(3)
    dist.all_reduce(t)
    os.write(1, f"R rank {rank} sum {t.tolist()}\n".encode())
    dist.destroy_process_group()
    if rank == 1 and linger:
        time.sleep(4)
        os.write(1, b"R rank 1 lingered\n")


if __name__ == "__main__":
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    linger = not (len(sys.argv) > 2 and sys.argv[2] == "quick")
    procs = [ctx.Process(target=rank_main, args=(r, int(sys.argv[1]), linger)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    os.write(1, f"R exit codes {[p.exitcode for p in procs]}\n".encode())
