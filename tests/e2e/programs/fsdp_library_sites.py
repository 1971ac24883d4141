"""FSDP2's collectives, issued by torch's own frames (library callers), from several user lines.

A correct 2-rank gloo program for tests/e2e/test_library_callers.py: the first call of each
(library line, arguments, user site) is recorded by ddpdoctor's general path, every repeat by
the cached library-caller path (rank/patches/libcalls.py); both must write the same records,
with the user's line as the site: the forward's all-gathers at ``# L:fwd`` or ``# L:fwd2``
(the same FSDP line reached from two user lines is two sites), the backward's at ``# L:bwd``.
The losses go to OUT/result-rank<R>.json (compared with an untraced run).

Usage: fsdp_library_sites.py OUT
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

STEPS = 5


def main() -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for i in range(STEPS):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        if i % 2:
            out = model(x)  # L:fwd2
        else:
            out = model(x)  # L:fwd
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()  # L:bwd
        opt.step()
        losses.append(round(loss.item(), 6))
        dist.barrier()  # L:step
    with open(os.path.join(sys.argv[1], f"result-rank{rank}.json"), "w") as f:
        json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
