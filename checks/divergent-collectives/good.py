"""divergent-collectives, good: the same early stopping, decided together. Every rank
contributes its local verdict and all ranks take the same decision (all_reduce with MAX).

Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/divergent-collectives/good.py
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
        dist.all_reduce(grad)
        loss *= 0.5 if rank == 0 else 0.8
        stop = torch.tensor([1.0 if loss < 0.2 else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # one decision for all ranks
        if stop.item() > 0:
            if rank == 0:
                print(f"stopping after step {step}")
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
