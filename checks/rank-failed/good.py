"""rank-failed, good: a rank that cannot load its sample says so, and all ranks skip it together.

The failure is turned into data (a flag all-reduced every step), so no rank is left waiting.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/rank-failed/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def load_sample(rank: int, step: int) -> torch.Tensor:
    if rank == 1 and step == 2:
        raise ValueError(f"corrupt sample at step {step}")
    return torch.full((4,), float(step))


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    for step in range(4):
        try:
            x, bad = load_sample(rank, step), 0.0
        except ValueError:
            x, bad = torch.zeros(4), 1.0
        flag = torch.tensor([bad])
        dist.all_reduce(flag)  # every rank learns that some rank failed this step
        if flag.item() > 0:
            continue
        dist.all_reduce(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
