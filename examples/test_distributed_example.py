"""Distributed tests that fail fast, with ddpdoctor's diagnosis, instead of hanging. Copy me.

Two ways to run distributed code in a test:

* ``ddpdoctor.spawn`` starts the ranks from an ordinary pytest run:
      pytest examples/test_distributed_example.py
* every rank runs pytest itself, and ``@pytest.mark.ddpdoctor`` checks the test body:
      torchrun --nproc_per_node=2 -m pytest -p no:cacheprovider examples/test_distributed_example.py

Either way a rank-divergent branch, a hang (a collective pending longer than ``hang_timeout``),
or a bug such as all-reducing DDP gradients by hand fails the test with the ranks, the source
lines and the fix in pytest's output.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpdoctor

UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
#: Bounds the process group's own waits too (a test must never wait the 30 min default).
PG_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60")))


def make_training(seed: int = 0):
    torch.manual_seed(seed)  # the same model and data on every rank; DDP broadcasts rank 0's weights
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=seed)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, loader, sampler


def train_one_epoch(model, opt, loader) -> float:
    total = torch.zeros(1)
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP averages the gradients here: no manual all_reduce
        opt.step()
        total += loss.detach()
    dist.all_reduce(total)  # a metric for logging: fine
    return total.item() / dist.get_world_size()


# -- style 1: ddpdoctor.spawn from a plain pytest run ---------------------------------------------

def worker(rank: int, world_size: int) -> None:
    # spawn() sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; the worker initialises the group.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    model, opt, loader, sampler = make_training()
    with ddpdoctor.check(hang_timeout=10):
        for epoch in range(2):
            sampler.set_epoch(epoch)
            train_one_epoch(model, opt, loader)
    dist.destroy_process_group()


@pytest.mark.skipif(UNDER_TORCHRUN, reason="starts its own ranks: run it with plain pytest")
def test_training_is_consistent():
    ddpdoctor.spawn(worker, world_size=2, timeout=120, args=(2,))


# -- style 2: every rank runs pytest (torchrun ... -m pytest) ---------------------------------------

@pytest.fixture(scope="session")
def process_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)  # torchrun's environment
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.skipif(not UNDER_TORCHRUN, reason="every rank must run pytest: use torchrun -m pytest")
@pytest.mark.ddpdoctor(hang_timeout=10)
def test_epoch_is_consistent_across_ranks(process_group):
    model, opt, loader, sampler = make_training()
    sampler.set_epoch(0)
    loss = train_one_epoch(model, opt, loader)
    assert loss == loss  # not NaN
