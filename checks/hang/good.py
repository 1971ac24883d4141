"""hang, good: rank 0 evaluates alone on the *unwrapped* module (no collective inside) and the
ranks then meet in the barrier; rank 0 also spends a moment writing a checkpoint. Nothing waits
anywhere near the hang timeout.

Run: ddpdoctor trace --hang-timeout 5 -- torchrun --nproc_per_node=2 checks/hang/good.py
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    model(torch.randn(8, 4)).sum().backward()
    if rank == 0:
        model.module.eval()
        with torch.no_grad():
            model.module(torch.randn(8, 4))  # the plain module: no communication
        with tempfile.TemporaryDirectory() as d:
            torch.save(model.module.state_dict(), os.path.join(d, "ckpt.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
