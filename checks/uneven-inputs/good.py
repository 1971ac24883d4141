"""uneven-inputs, good: the same uneven split, trained inside ``Join``.

``Join`` lets the rank that runs out of batches shadow the others' gradient all-reduces, so the
ranks finish together. (Alternatives: ``DistributedSampler`` pads to equal length;
``drop_last=True`` drops the remainder.)
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/uneven-inputs/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(9, 8)
    mine = data[rank::world]  # 5 and 4 batches, as in bad.py
    with Join([model]):
        for x in mine:
            opt.zero_grad()
            loss = model(x.unsqueeze(0)).pow(2).mean()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
