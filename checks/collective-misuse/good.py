"""collective-misuse, good: every collective runs while the process group lives, and the
subgroups are created by every rank, in the same order, with the same members.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/collective-misuse/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # all ranks, same order
    dist.all_reduce(torch.ones(1), group=groups[rank])
    metric = torch.tensor([float(rank)])
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    dist.all_reduce(metric)
    dist.destroy_process_group()  # last
    print(f"mean metric {metric.item() / 2}")


if __name__ == "__main__":
    main()
