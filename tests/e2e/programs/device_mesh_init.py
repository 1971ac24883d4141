"""The job initialised by init_device_mesh (which calls init_process_group itself, through a
name torch.distributed.device_mesh imported while torch was imported), then a tensor-parallel
Linear pair (DTensor) and one all_reduce of the loss."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = parallelize_module(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)), mesh,
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
total = loss.detach().clone()
dist.all_reduce(total)
print(f"rank {dist.get_rank()} total {total.item():.6f}")
dist.destroy_process_group()
