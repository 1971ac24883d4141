"""all_gather with per-rank sizes that gloo completes on one rank (partially filled buffers) and
aborts on the other; the rank that completed it fails in its next collective. DD002 must name the
all_gather, not only the later failure."""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(8))
    n = 4000 + 1000 * rank
    out = [torch.zeros(n) for _ in range(2)]
    dist.all_gather(out, torch.ones(n))  # the bug: sizes differ across ranks
    for _ in range(3):
        dist.all_reduce(torch.ones(10))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
