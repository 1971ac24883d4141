"""Every public torch.distributed operation once, plus DDP and a DataLoader with workers.

A correct 2-rank gloo program for tests/test_trace_ops.py, run under ``torchrun`` (or any launcher
that sets RANK/WORLD_SIZE/MASTER_*). Each call that must become exactly one trace event carries a
``# L:<op>`` marker on its line; the test finds those lines and checks the event recorded there.
What the program observed (results, exceptions, signatures) goes to ``OUT/result-rank<R>.json``.

Usage: trace_ops.py OUT
"""

import datetime
import inspect
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # bound at import: must still be traced
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

seen: dict = {"errors": {}, "orig_errors": {}, "values": {}}


class Outcome:
    """Keep going past an operation the backend does not support, remembering its exception
    and the exception of the same call made to the original function under ddpdoctor's wrapper."""

    def __init__(self, name: str, again=None) -> None:
        self.name, self.again = name, again

    def __enter__(self):
        return self

    def __exit__(self, etype, exc, tb):
        if exc is None:
            return False
        seen["errors"][self.name] = [etype.__name__, str(exc)]
        if self.again is not None:
            try:
                self.again()
            except Exception as exc2:
                seen["orig_errors"][self.name] = [type(exc2).__name__, str(exc2)]
        return issubclass(etype, Exception)


def unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)


def collectives(rank: int, world: int) -> None:
    t = torch.ones(4)
    dist.barrier()  # L:barrier
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))  # L:monitored_barrier
    dist.all_reduce(t)  # L:all_reduce
    seen["values"]["all_reduce"] = t.tolist()
    m = torch.full((2, 3), float(rank))
    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # L:all_reduce:max
    seen["values"]["all_reduce_max"] = m[0, 0].item()
    all_reduce(t)  # L:all_reduce:bound
    r = torch.ones(4)
    dist.reduce(r, dst=0, op=dist.ReduceOp.SUM)  # L:reduce
    b = torch.arange(3) + rank
    dist.broadcast(b, src=1)  # L:broadcast
    seen["values"]["broadcast"] = b.tolist()
    gl = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(gl, torch.full((4,), float(rank)))  # L:all_gather
    seen["values"]["all_gather"] = [x[0].item() for x in gl]
    big = torch.zeros(2 * world)
    dist.all_gather_into_tensor(big, torch.full((2,), float(rank)))  # L:all_gather_into_tensor
    seen["values"]["all_gather_into_tensor"] = big.tolist()
    single = torch.zeros(2 * world)
    dist.all_gather_single(single, torch.full((2,), float(rank)))  # L:all_gather_single
    rss_out = torch.zeros(2)
    dist.reduce_scatter_single(rss_out, torch.ones(2 * world))  # L:reduce_scatter_single
    seen["values"]["reduce_scatter_single"] = rss_out.tolist()
    rs_out, rs_in = torch.zeros(2), [torch.ones(2) for _ in range(world)]
    with Outcome("reduce_scatter", lambda: unwrapped(dist.reduce_scatter)(rs_out, rs_in)):
        dist.reduce_scatter(rs_out, rs_in)  # L:reduce_scatter
    rst_out = torch.zeros(2)
    with Outcome("reduce_scatter_tensor",
                 lambda: unwrapped(dist.reduce_scatter_tensor)(rst_out, torch.ones(2 * world))):
        dist.reduce_scatter_tensor(rst_out, torch.ones(2 * world))  # L:reduce_scatter_tensor
    a2a_out = [torch.zeros(1) for _ in range(world)]
    a2a_in = [torch.full((1,), float(rank * 10 + i)) for i in range(world)]
    with Outcome("all_to_all", lambda: unwrapped(dist.all_to_all)(a2a_out, a2a_in)):
        dist.all_to_all(a2a_out, a2a_in)  # L:all_to_all
    a2as_out = torch.zeros(world)
    a2as_in = torch.arange(world, dtype=torch.float32) + 10 * rank
    with Outcome("all_to_all_single", lambda: unwrapped(dist.all_to_all_single)(a2as_out, a2as_in)):
        dist.all_to_all_single(a2as_out, a2as_in)  # L:all_to_all_single
    glist = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gather_list=glist, dst=0)  # L:gather
    if rank == 0:
        seen["values"]["gather"] = [x[0].item() for x in glist]
    sc = torch.zeros(2)
    slist = [torch.full((2,), float(i)) for i in range(world)] if rank == 0 else None
    dist.scatter(sc, scatter_list=slist, src=0)  # L:scatter
    seen["values"]["scatter"] = sc[0].item()
    # async: one event at issue, one wait record when the work completes
    work = dist.all_reduce(torch.ones(3), async_op=True)  # L:all_reduce:async
    seen["values"]["async_return"] = type(work).__name__
    work.wait()
    seen["values"]["all_reduce_return"] = repr(dist.all_reduce(torch.ones(1)))  # L:all_reduce:ret
    # async work completed through its future and dropped, never wait()ed: no wait record, and
    # the next Work (likely at the same address) is not taken for it
    for _ in range(3):
        dropped = dist.all_reduce(torch.ones(2), async_op=True)  # L:all_reduce:dropped
        dropped.get_future().wait()
        del dropped
        dist.all_reduce(torch.ones(2))  # L:all_reduce:after_dropped


def point_to_point(rank: int) -> None:
    peer = 1 - rank
    x = torch.full((5,), float(rank))
    if rank == 0:
        dist.send(x, dst=1)  # L:send
    else:
        dist.recv(x, src=0)  # L:recv
        seen["values"]["recv"] = x[0].item()
    y = torch.zeros(2, dtype=torch.int64)
    if rank == 1:
        w = dist.isend(y + 7, dst=0)  # L:isend
    else:
        w = dist.irecv(y, src=1)  # L:irecv
    w.wait()
    seen["values"]["irecv"] = y.tolist()
    z_out, z_in = torch.full((3,), float(rank)), torch.zeros(3)
    ops = [dist.P2POp(dist.isend, z_out, peer), dist.P2POp(dist.irecv, z_in, peer)]
    for req in dist.batch_isend_irecv(ops):  # L:batch_isend_irecv
        req.wait()
    seen["values"]["batch"] = z_in[0].item()


def objects(rank: int, world: int) -> None:
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})  # L:all_gather_object
    seen["values"]["all_gather_object"] = objs
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)  # L:gather_object
    if rank == 0:
        seen["values"]["gather_object"] = gathered
    blist = [f"from{rank}", rank]
    dist.broadcast_object_list(blist, src=0)  # L:broadcast_object_list
    seen["values"]["broadcast_object_list"] = blist
    out = [None]
    dist.scatter_object_list(out, [f"s{i}" for i in range(world)] if rank == 0 else None, src=0)  # L:scatter_object_list
    seen["values"]["scatter_object_list"] = out
    box = [{"k": rank}]
    if rank == 0:
        dist.send_object_list(box, dst=1)  # L:send_object_list
    else:
        dist.recv_object_list(box, src=0)  # L:recv_object_list
        seen["values"]["recv_object_list"] = box


def groups(rank: int, world: int) -> None:
    both = dist.new_group([0, 1])  # L:new_group
    t = torch.ones(2)
    dist.all_reduce(t, group=both)  # L:all_reduce:subgroup
    dist.barrier(group=both)  # L:barrier:subgroup
    only0 = dist.new_group([0])  # L:new_group:only0
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=only0)  # L:all_reduce:only0
    mine, _all = dist.new_subgroups(group_size=1)  # L:new_subgroups
    dist.all_reduce(torch.ones(1), group=mine)  # L:all_reduce:mine


def bad_arguments(rank: int) -> None:
    """Misuse raises the very same exception with and without ddpdoctor."""
    with Outcome("bad_tensor", lambda: unwrapped(dist.all_reduce)([1, 2])):
        dist.all_reduce([1, 2])  # L:all_reduce:bad
    with Outcome("bad_src", lambda: unwrapped(dist.broadcast)(torch.ones(1), src=7)):
        dist.broadcast(torch.ones(1), src=7)  # L:broadcast:bad


def ddp_and_data(rank: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ddp = DDP(model)  # L:ddp_init
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16, 4))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    steps = 0
    for (xb,) in loader:
        loss = ddp(xb).sum()  # L:ddp_forward
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    seen["values"]["steps"] = steps
    # No buffers, no grad: this forward does not communicate (a local event, no sequence number).
    plain = DDP(torch.nn.Linear(2, 2))  # L:ddp_init:plain
    with torch.no_grad():
        plain(torch.ones(1, 2))  # L:ddp_forward:local


def main() -> None:
    out = sys.argv[1]
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)  # L:init
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "this program is written for 2 ranks"
    wrapper = dist.all_reduce
    seen["api"] = {
        "wrapped": bool(getattr(wrapper, "__ddpdoctor_wrapped__", False)),
        "bound_is_patched": all_reduce is wrapper,
        "same_in_c10d": wrapper is dist.distributed_c10d.all_reduce,
        "signature": str(inspect.signature(wrapper)),
        "orig_signature": str(inspect.signature(unwrapped(wrapper))),
        "doc_same": wrapper.__doc__ == unwrapped(wrapper).__doc__ and bool(wrapper.__doc__),
        "name": wrapper.__name__,
    }
    collectives(rank, world)
    point_to_point(rank)
    objects(rank, world)
    groups(rank, world)
    bad_arguments(rank)
    ddp_and_data(rank)
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(seen, f, default=repr)
    dist.destroy_process_group()  # L:destroy


if __name__ == "__main__":
    main()
