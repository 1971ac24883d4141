"""A correct program with subgroups, a p2p pipeline and batched p2p: no finding expected."""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    # One subgroup per rank pair and one with everyone: every rank creates all of them, in order.
    solo = [dist.new_group([r]) for r in range(world)]
    everyone = dist.new_group(list(range(world)))
    mine = solo[rank]
    x = torch.ones(3) * rank
    dist.all_reduce(x, group=mine)  # a group of one: only this rank
    dist.all_reduce(x, group=everyone)
    # A two-stage pipeline: rank 0 sends activations, rank 1 receives, computes, sends grads back.
    for _micro in range(4):
        if rank == 0:
            dist.send(torch.randn(2, 4), dst=1)
            g = torch.empty(2, 4)
            dist.recv(g, src=1)
        elif rank == 1:
            a = torch.empty(2, 4)
            dist.recv(a, src=0)
            dist.send(a * 2, dst=0)
    # Batched p2p ring exchange.
    send = torch.full((2,), float(rank))
    recv = torch.empty(2)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # Asynchronous p2p.
    if rank == 0:
        dist.isend(torch.ones(1), dst=1).wait()
    elif rank == 1:
        buf = torch.empty(1)
        dist.irecv(buf, src=0).wait()
    # Rank-0-only work between collectives (logging, a small file) is fine.
    if rank == 0:
        print("pipeline done")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
