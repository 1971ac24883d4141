"""Correct program: a 2-stage pipeline with torch.distributed.pipelining (Schedule1F1B, 4
microbatches), each rank one stage with its own optimizer.

The schedule exchanges shape metadata with send_object_list/recv_object_list(use_batch=True)
(a batch_isend_irecv and a wait inside an object collective) and then streams activations and
gradients with batched isend/irecv: only the stage that holds the targets computes a loss.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
full = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
part = full[0:2] if rank == 0 else full[2:]
stage = PipelineStage(part, rank, world, torch.device("cpu"))
schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
opt = torch.optim.SGD(part.parameters(), lr=0.01)
for step in range(3):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    if rank == 0:
        schedule.step(x)
    else:
        losses: list = []
        schedule.step(target=y, losses=losses)
        print("step", step, "loss", sum(loss.item() for loss in losses))
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
