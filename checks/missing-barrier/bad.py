"""missing-barrier, bad: rank 0 saves a checkpoint and rank 1 loads it with no collective between.

Rank 1 polls until the file exists, so the run usually "works"; nothing orders rank 0's write
before rank 1's read, though: rank 1 can load a half-written file, or an older checkpoint left
by a previous run. ddpdoctor decides this from the collectives, not from timing.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/missing-barrier/bad.py
"""

import datetime
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    # one folder per job, the same on every rank (the port is unique to this job)
    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-mb-bad-{os.environ['MASTER_PORT']}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ckpt.pt")
    model = torch.nn.Linear(4, 2)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), path)  # the write ...
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling is not synchronisation
        time.sleep(0.2)
        model.load_state_dict(torch.load(path))  # ... and the read, with no collective between
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
