"""A single process that imports torch and never initialises a process group
(tests/test_trace_jobs.py). Prints one JSON line: whether torch.distributed was instrumented and
what ``sitecustomize`` module the interpreter ran; then ends as asked.

Usage: trace_noinit.py exit CODE | trace_noinit.py signal SIGNUM
"""

import json
import os
import sys

import torch
import torch.distributed as dist

site = sys.modules.get("sitecustomize")
print(json.dumps({
    "patched": bool(getattr(dist.all_reduce, "__ddpdoctor_wrapped__", False)),
    "user_sitecustomize": getattr(site, "USER_MARK", None),
    "sum": float(torch.ones(3).sum()),
}), flush=True)
if sys.argv[1] == "signal":
    os.kill(os.getpid(), int(sys.argv[2]))
sys.exit(int(sys.argv[2]))
