"""A nanoGPT-style training script (karpathy/nanoGPT train.py's structure) under torchrun, CPU.

``master_process`` guards, the optimizer built before the model is wrapped in DDP, an evaluation
at iteration 0 before the first step. ``bad``: the evaluation, whose loss is averaged over the
ranks with an all_reduce, runs on the master process only. ``good``: every rank evaluates, the
master process prints.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

bug = sys.argv[1:] == ["bad"]
eval_interval = 2
eval_iters = 2
max_iters = 4
block_size, vocab = 8, 16

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
torch.manual_seed(1337 + seed_offset)


def get_batch(split):
    data = torch.randint(0, vocab, (64,))
    ix = torch.randint(len(data) - block_size, (4,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, lr):
        return torch.optim.AdamW(self.parameters(), lr=lr)


model = GPT()
optimizer = model.configure_optimizers(1e-3)  # built before the DDP wrapping, as in nanoGPT
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = raw_model(X, Y)
            losses[k] = loss.item()
        mean = losses.mean()
        if ddp:
            dist.all_reduce(mean)  # the ranks' average
            mean /= ddp_world_size
        out[split] = mean
    model.train()
    return out


iter_num = 0
X, Y = get_batch("train")
while True:
    if bug:
        if iter_num % eval_interval == 0 and master_process:  # (guard)
            losses = estimate_loss()  # BUG: all_reduce inside, on the master process only
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    elif iter_num % eval_interval == 0:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    logits, loss = model(X, Y)
    X, Y = get_batch("train")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
