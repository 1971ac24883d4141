"""A collective inside ``torch.compile(fullgraph=True)`` (eager backend: no C++ compiler needed).

Traced, ddpdoctor's wrapper of ``all_reduce`` must stay traceable by Dynamo: a wrapper Dynamo
cannot trace would break the graph, an error under ``fullgraph=True``. Prints the result.

Usage: compiled_collective.py
"""

import datetime
import os

import torch
import torch.distributed as dist


def step(t):
    dist.all_reduce(t)
    return t * 2


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT", "60"))))
    fn = torch.compile(step, backend="eager", fullgraph=True)
    print("result", fn(torch.ones(2)).tolist(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
