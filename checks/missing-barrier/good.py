"""missing-barrier, good: shared files are written by one rank and read after a barrier.

Also shows what must stay silent: makedirs(exist_ok=True) on every rank, per-rank file names, an
atomic write (temporary file renamed onto the final name) followed by a barrier, a shared log
that every rank appends to, and removal by one rank after the last barrier.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/missing-barrier/good.py
"""

import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    folder = os.path.join(tempfile.gettempdir(), f"ddpdoctor-mb-good-{os.environ['MASTER_PORT']}")
    os.makedirs(folder, exist_ok=True)  # every rank: fine
    ckpt = os.path.join(folder, "ckpt.pt")
    model = torch.nn.Linear(4, 2)

    if rank == 0:
        torch.save(model.state_dict(), ckpt)
    dist.barrier()  # the write happens before every rank's read
    model.load_state_dict(torch.load(ckpt))

    torch.save({"rank": rank}, os.path.join(folder, f"state-rank{rank}.pt"))  # per-rank names

    latest = os.path.join(folder, "latest.pt")
    if rank == 0:
        tmp = latest + ".tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, latest)  # atomic publish
    dist.barrier()
    model.load_state_dict(torch.load(latest))

    with open(os.path.join(folder, "train.log"), "a") as log:  # a shared append-only log
        log.write(f"rank {rank} done\n")

    dist.barrier()  # everyone is done with the folder before it is removed
    if rank == 0:
        shutil.rmtree(folder)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
