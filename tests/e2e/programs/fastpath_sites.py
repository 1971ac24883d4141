"""Repeat calls from one call site, which ddpdoctor records through its fast path (a cached
``Hit`` per call site and argument shape), next to the first call of each (the general path).

A correct 2-rank gloo program for tests/e2e/test_fastpath.py. ``helper_a`` and ``helper_b`` have
the same bytecode and are reached through ``run_a``/``run_b``, also alike: the same instruction
offsets everywhere, different code objects, so their calls must stay two call sites. Each
``# L:<name>`` line is called ROUNDS times; the arguments change shape, dtype, reduce op, keyword
form and async mode between calls from one line. The rank's results go to OUT/result-rank<R>.json.

Usage: fastpath_sites.py OUT
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

ROUNDS = 4


def helper_a(t):
    dist.all_reduce(t)  # L:a


def helper_b(t):
    dist.all_reduce(t)  # L:b


def run_a(t):
    helper_a(t)


def run_b(t):
    helper_b(t)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()
    out: dict = {"sums": [], "maxes": [], "errors": []}
    for i in range(ROUNDS):
        run_a(torch.ones(1))
        run_b(torch.ones(2))
        t = torch.ones(1 + i % 2, dtype=torch.float64 if i >= 2 else torch.float32)
        dist.all_reduce(t)  # L:shapes
        out["sums"].append(t.tolist())
        m = torch.tensor([float(rank + i)])
        if i % 2:
            dist.all_reduce(m, op=dist.ReduceOp.MAX)  # L:max
        else:
            dist.all_reduce(m, dist.ReduceOp.MAX)  # L:max_pos
        out["maxes"].append(m.tolist())
        dist.all_reduce(torch.ones(3), async_op=True).wait()  # L:async
        try:
            dist.broadcast(torch.ones(1), src=dist.get_world_size() + 3)  # L:bad_src
        except Exception as exc:  # noqa: BLE001 - what torch raises is what the test compares
            out["errors"].append(type(exc).__name__)
    dist.barrier()
    with open(os.path.join(sys.argv[1], f"result-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
