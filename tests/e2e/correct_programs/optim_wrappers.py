"""Correct program: optimizer and communication wrappers that look suspicious to a naive checker.

ZeroRedundancyOptimizer (each rank steps its own shard, then the shards are broadcast: the inner
step sees replicas that differ by design), gradient accumulation under no_sync, activation
checkpointing, a batch_isend_irecv ring, all_gather_object metrics, early stopping on an
all-reduced flag, gradients synchronised by hand after backwards under no_sync (the only
reduction, though DDP reduced earlier steps), the ZeRO state consolidated to rank 0 and saved
there only.
"""

import os
import random
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False)
        return self.b(h)


model = DDP(Net())
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
g = torch.Generator().manual_seed(100 + rank)  # each rank's own data: intended
best, patience = float("inf"), 0
for epoch in range(6):
    for step in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step % 2 == 0:  # accumulate locally, all-reduce on the next backward
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
        else:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    send, recv = torch.full((2,), float(rank)), torch.empty(2)
    ring = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ring):
        work.wait()
    loss = torch.tensor([float(random.Random(epoch).random())])
    dist.all_reduce(loss)
    metrics = [None] * world
    dist.all_gather_object(metrics, {"rank": rank, "loss": loss.item()})
    if rank == 0:
        print("epoch", epoch, metrics)
    if loss.item() < best:
        best, patience = loss.item(), 0
    else:
        patience += 1
    stop = torch.tensor([1 if patience >= 2 else 0])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the same decision on every rank
    if stop.item():
        break


def synced_by_hand(x, y):
    """DDP's reduction skipped, the gradients all-reduced here instead (e.g. in another dtype or
    over a custom group): the only reduction, not a second one."""
    with model.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()


for _ in range(2):
    synced_by_hand(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
opt.consolidate_state_dict(to=0)
if rank == 0:
    torch.save(opt.state_dict(), os.path.join(tempfile.mkdtemp(), "opt.pt"))
dist.barrier()
dist.destroy_process_group()
