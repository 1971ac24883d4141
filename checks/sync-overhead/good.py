"""sync-overhead, good: the same training loop, balanced, and one barrier at the end (before
rank 0 saves the model), where it is needed.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/sync-overhead/good.py
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("EXAMPLE_STEPS", "40"))


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        x = torch.randn(4, 8)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    dist.barrier()  # every rank has finished training before rank 0 saves
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.module.state_dict(), os.path.join(tmp, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
