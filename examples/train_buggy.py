"""A small DDP training run with the bugs people really write. Run it under ddpdoctor:

    ddpdoctor trace --hang-timeout 8 --on-hang kill -- torchrun --nproc_per_node=2 examples/train_buggy.py

Without ddpdoctor it trains "fine" for two epochs (every bug but the last is silent) and then
hangs for 30 minutes in validation before gloo times out with no rank or line named.
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler

CKPT = os.environ.get("DEMO_CKPT", "/tmp/ddpdoctor-demo/ckpt.pt")


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "1800")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()

    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    # Bug 1: the split is drawn from each rank's own unseeded RNG: the ranks train on
    # different "training sets" and validate on each other's training data.
    train_set, val_set = random_split(data, [192, 64])

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    for epoch in range(2):  # noqa: B007 - unused: that is bug 2
        # Bug 2: no sampler.set_epoch(epoch): every epoch sees the same order.
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            # Bug 3: DDP already averaged the gradients; this sums them again (x world size).
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
        if rank == 0:
            os.makedirs(os.path.dirname(CKPT), exist_ok=True)
            torch.save(model.module.state_dict(), CKPT)
        else:
            # Bug 4: no barrier between rank 0's save and this load: rank 1 may read a
            # half-written or last epoch's checkpoint (or none at all).
            try:
                model.module.load_state_dict(torch.load(CKPT))
            except (FileNotFoundError, RuntimeError, EOFError):
                pass

    val_loss = torch.zeros(1)
    with torch.no_grad():
        for x, y in DataLoader(val_set, batch_size=16):
            val_loss += nn.functional.mse_loss(model.module(x), y)
    # Bug 5: only rank 0 averages the validation loss; rank 1 goes on to the final barrier.
    if rank == 0:
        dist.all_reduce(val_loss)
        print(f"validation loss {val_loss.item() / dist.get_world_size():.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
