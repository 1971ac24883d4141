"""A correct DDP training script in the style people really write: no finding expected.

DistributedSampler with set_epoch, a seeded split, per-rank augmentation noise (intended to
differ), rank-0-only logging and checkpointing followed by a barrier, validation on all ranks
with an all-reduced metric, an async all_reduce, object collectives, rank-0-only evaluation
through the DDP model on a buffer-free model under no_grad (no communication), early stopping
on an all-reduced flag.
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "30"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the same on every rank: same init, same split
    data = TensorDataset(torch.randn(160, 6), torch.randn(160, 1))
    train_set, val_set = random_split(data, [128, 32], generator=torch.Generator().manual_seed(0))
    sampler = DistributedSampler(train_set, shuffle=True, seed=7)
    loader = DataLoader(train_set, batch_size=16, sampler=sampler, num_workers=0)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    aug = torch.Generator().manual_seed(1000 + rank)  # per-rank augmentation: meant to differ
    ckpt_dir = None
    if rank == 0:
        ckpt_dir = tempfile.mkdtemp(prefix="ddpdoctor-good-")
    ckpt_dir = [ckpt_dir]
    dist.broadcast_object_list(ckpt_dir, src=0)
    ckpt = os.path.join(ckpt_dir[0], "last.pt")
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(1)
        for x, y in loader:
            x = x + 0.01 * torch.randn(x.shape, generator=aug)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        work = dist.all_reduce(total, async_op=True)  # logging metric, overlapped
        work.wait()
        if rank == 0:
            print(f"epoch {epoch} train loss {total.item() / world:.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, ckpt)
        dist.barrier()  # the checkpoint exists before anyone reads it
        state = torch.load(ckpt)
        assert state["epoch"] == epoch
        model.eval()
        val = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                val[0] += nn.functional.mse_loss(model(x), y, reduction="sum")
                val[1] += len(x)
        dist.all_reduce(val)
        stats = [None] * world
        dist.all_gather_object(stats, {"rank": rank, "val": float(val[0] / val[1])})
        stop = torch.tensor([1.0 if float(val[0] / val[1]) < 1e-6 else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # early stopping decided together
        if stop.item() > 0:
            break
    if rank == 0:
        with torch.no_grad():  # a buffer-free DDP model under no_grad does not communicate
            model(torch.randn(4, 6))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
