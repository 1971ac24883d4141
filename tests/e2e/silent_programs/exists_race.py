"""Rank 0 saves a checkpoint; rank 1 checks whether it exists with no collective between, finds
none yet and fails. DD003 must name the write and the check, not only the failure."""

import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-exists-{os.environ['MASTER_PORT']}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ckpt.pt")
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)  # a slow save: the other rank looks before it
        torch.save({"w": torch.ones(3)}, path)  # the write
    else:
        found = os.path.exists(path)  # the check
        time.sleep(3.0)  # other work (so that the launcher does not end rank 0 before its save)
        if not found:
            raise FileNotFoundError(f"no checkpoint at {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
