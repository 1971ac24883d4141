"""A 2-rank program whose library calls warn with stacklevel >= 2 from inside functions that
ddpdoctor wraps (the DataLoader iterator's constructor): the warning must name the same line
traced as plain."""
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
data = TensorDataset(torch.arange(16.0).unsqueeze(1))
loader = DataLoader(data, batch_size=4, pin_memory=True, sampler=DistributedSampler(data))
total = torch.zeros(1)
for epoch in range(2):
    loader.sampler.set_epoch(epoch)
    for (x,) in loader:  # pin_memory=True without an accelerator: torch warns here
        total += x.sum()
dist.all_reduce(total)
print("total", total.item())
dist.destroy_process_group()
