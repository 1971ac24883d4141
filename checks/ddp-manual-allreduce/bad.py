"""ddp-manual-allreduce, bad: a DDP model whose gradients are all-reduced again by hand.

DDP's backward already averaged the gradients; the loop below sums the averages, so every
gradient comes out multiplied by the world size (a silently larger learning rate). With
gradient_as_bucket_view=True the gradients are views into DDP's buckets, which the recorder
still tells apart (weight.grad vs bias.grad).
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/ddp-manual-allreduce/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the bug: DDP has already reduced these
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
