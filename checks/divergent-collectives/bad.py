"""divergent-collectives, bad: early stopping on a *local* metric. Each rank decides on its own
loss when to stop; the rank that stops first leaves the loop, the other issues the next step's
all_reduce alone (a hang until the backend's timeout).

Run: ddpdoctor trace --hang-timeout 5 --on-hang kill -- torchrun --nproc_per_node=2 checks/divergent-collectives/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    loss = 1.0
    for step in range(10):
        grad = torch.full((4,), loss)
        dist.all_reduce(grad)  # the step's gradient exchange
        loss *= 0.5 if rank == 0 else 0.8  # each rank sees its own data, its own loss
        if loss < 0.2:  # the bug: a local decision to stop
            print(f"rank {rank} stops after step {step}")
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
