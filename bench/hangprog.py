"""A divergent-branch hang for the hang-latency benchmark (``torchrun --nproc_per_node=N``).

Rank 0 all-reduces a metric that the other ranks never reduce; they go on to a barrier. The
process-group timeout is long on purpose: the job must end through ddpdoctor's diagnosis
(``--on-hang kill``), never through gloo's timeout.
"""

import argparse
import datetime

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg-timeout", type=float, default=300)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    x = torch.ones(16)
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # only rank 0: the others are in the barrier below
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
