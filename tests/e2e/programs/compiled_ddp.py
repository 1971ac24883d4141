"""A DDP model under torch.compile (one eager step first, then compiled steps): the program's own
output must not change under ddpdoctor, and the DDP steps must still be recorded."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
step_model = model
for step in range(4):
    if step == 1:  # compiled after one eager step, as many training scripts do
        step_model = torch.compile(model, backend="aot_eager")
    loss = step_model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
if rank == 0:
    print(f"final {total.item():.6f}")
dist.destroy_process_group()
