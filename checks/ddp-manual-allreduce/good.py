"""ddp-manual-allreduce, good: DDP reduces the gradients; only the loss is all-reduced, for logging.

The loss is reduced both before backward and after the optimizer step (when freed gradient memory
may be reused for the new tensor); neither shares memory with the gradients. DDP's own reduction
through a communication hook (an all_reduce of the bucket that the gradients are views of, with
gradient_as_bucket_view=True) is DDP's, not a second one.
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/ddp-manual-allreduce/good.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2), gradient_as_bucket_view=True)
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # all_reduce of the bucket, in backward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # a metric: fine
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # gradients freed: their memory can be reused below
        mean_loss = torch.tensor([logged.item() / world])
        dist.all_reduce(mean_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
