"""collective-misuse, bad: the process group is destroyed before the last all-reduce.

``cleanup()`` runs before the final metric is averaged, so ``all_reduce`` raises "Default process
group has not been initialized" on every rank.
With the argument ``groups``, the ranks instead create a subgroup each with a different member
list (rank 0 ``new_group([0])``, rank 1 ``new_group([1])``): both get a group of the same name.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/collective-misuse/bad.py [groups]
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist


def cleanup() -> None:
    dist.destroy_process_group()


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    if sys.argv[1:] == ["groups"]:
        mine = dist.new_group([rank])  # the bug: every rank must create every group, in the same order
        dist.all_reduce(torch.ones(1), group=mine)
        dist.barrier()
        cleanup()
        return
    metric = torch.tensor([float(rank)])
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    cleanup()  # the bug: too early
    dist.all_reduce(metric)
    print(f"mean metric {metric.item() / 2}")


if __name__ == "__main__":
    main()
