"""`ddpdoctor lint` on values each rank computes from its own shard of the data (source/shards.py):
early stopping on a local validation loss, skipping a step on a local NaN. The loader itself
(its length, a loop over it, a batch's shape) is the same on every rank of a padded sampler, and
a value all-reduced, broadcast or gathered is the same everywhere again: those stay silent."""

from __future__ import annotations

import textwrap

from ddpdoctor.lint.config import LintConfig
from ddpdoctor.lint.engine import lint_modules
from ddpdoctor.source.rankdep import condition_is_rank_dependent
from ddpdoctor.source.units import Module

HEAD = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
dist.init_process_group('gloo')
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False))
val = DataLoader(vs, batch_size=8, sampler=DistributedSampler(vs, shuffle=False))
"""
LINES = HEAD.count("\n")

EVALUATE = """\
def evaluate(loader):
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += ((model.module(x) - y) ** 2).sum().item()
    return total
"""


def found(src: str) -> list[tuple[str, str, int]]:
    findings, notes, _n = lint_modules([Module("snippet.py", HEAD + textwrap.dedent(src))], LintConfig())
    assert not notes, notes
    return [(f.id, f.severity, f.locations[0].line - LINES) for f in findings]


def test_early_stopping_on_a_local_validation_loss():
    src = EVALUATE + """\
best, bad = 1e9, 0
for epoch in range(100):
    for x, y in train:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    v = evaluate(val)
    if v < best:
        best, bad = v, 0
    else:
        bad += 1
    if bad >= 3:
        break
"""
    assert found(src) == [("DD001", "error", 18)]
    # the same decision on an all-reduced loss, or on a flag broadcast from rank 0: silent
    reduced = src.replace("    v = evaluate(val)\n", "    t = torch.tensor([evaluate(val)])\n"
                          "    dist.all_reduce(t)\n    v = t.item()\n")
    assert found(reduced) == []
    flag = src.replace("    if bad >= 3:\n", "    stop = torch.tensor([bad >= 3])\n"
                       "    dist.broadcast(stop, src=0)\n    if stop.item():\n")
    assert found(flag) == []
    # a validation set every rank reads whole (no DistributedSampler): the same loss everywhere
    whole = src.replace("v = evaluate(val)", "v = evaluate(DataLoader(vs, batch_size=8))")
    assert found(whole) == []


def test_a_while_loop_on_a_local_metric():
    src = EVALUATE + """\
stop = False
while not stop:
    for x, y in train:
        ((model(x) - y) ** 2).mean().backward()
    stop = evaluate(val) < 0.1
"""
    assert [f[0] for f in found(src)] == ["DD006"]


def test_skipping_a_step_on_a_local_nan_and_the_all_reduced_form():
    src = """\
for x, y in train:
    loss = ((model(x) - y) ** 2).mean()
    if torch.isnan(loss):
        continue
    loss.backward()
    opt.step()
"""
    assert found(src) == [("DD001", "error", 3)]
    agreed = src.replace("    if torch.isnan(loss):\n",
                         "    bad = torch.isnan(loss).float()\n    dist.all_reduce(bad, op=dist.ReduceOp.MAX)\n"
                         "    if bad.item():\n")
    assert found(agreed) == []


def test_loops_counts_and_shapes_of_the_loader_are_the_same_everywhere():
    assert found("""\
for epoch in range(3):
    for i, (x, y) in enumerate(train):
        if x.size(0) < 8 or len(y) < 8 or x.shape[0] != 8:
            continue
        loss = ((model(x) - y) ** 2).mean()
        if (i + 1) % 4 == 0:
            loss.backward()
            opt.step()
        else:
            with model.no_sync():
                loss.backward()
        if loss.item() > 1e6:
            print("large loss", loss.item())
    if len(train) > 0:
        dist.barrier()
batches = [b for b in train]
for b in batches:
    model(b)
""") == []


def test_params_and_fields_of_prepared_objects_are_not_data():
    assert found("""\
from accelerate import Accelerator
accelerator = Accelerator()
net, opt2, loader = accelerator.prepare(torch.nn.Linear(4, 1), opt, train)
for p in net.parameters():
    if p.grad is not None:
        dist.all_reduce(p.grad)
for batch in loader:
    out = net(batch)
    metric = accelerator.gather_for_metrics(out).mean()
    if metric > 0.5:
        dist.barrier()
""") == []


def test_the_offline_analysis_sees_the_same_dependence():
    src = HEAD + EVALUATE + "v = evaluate(val)\nif v < 0.5:\n    pass\nif len(val) > 2:\n    pass\n"
    line = src.count("\n") - 3
    verdict = condition_is_rank_dependent(src, line)
    assert verdict.state == "yes" and "own share of the data" in verdict.reason
    assert condition_is_rank_dependent(src, line + 2).state == "no"


def test_a_list_of_local_losses_and_a_meter_synchronised_by_its_own_method():
    src = """\
class Meter:
    def __init__(self):
        self.sum, self.n = 0.0, 0

    def update(self, v, n=1):
        self.sum += v * n
        self.n += n

    def all_reduce(self):
        t = torch.tensor([self.sum, self.n])
        dist.all_reduce(t)
        self.sum, self.n = t.tolist()

def validate(loader):
    losses = []
    meter = Meter()
    for x, y in loader:
        loss = ((model.module(x) - y) ** 2).mean()
        losses.append(loss.item())
        meter.update(loss.item(), len(x))
    SYNC
    return RESULT

for epoch in range(10):
    for x, y in train:
        ((model(x) - y) ** 2).mean().backward()
    if validate(val) < 0.1:
        break
"""
    # the mean of a list of this rank's losses: early stopping on it is the bug
    assert found(src.replace("SYNC", "pass").replace("RESULT", "sum(losses) / len(losses)")) == \
        [("DD001", "error", 27)]
    # the meter, all-reduced by its own method before its average is read: silent
    assert found(src.replace("SYNC", "meter.all_reduce()").replace("RESULT", "meter.sum / meter.n")) == []


def test_yolov5s_early_stopping_broadcast_from_rank_0_is_silent():
    """YOLOv5 (train.py): rank 0 decides, broadcasts its `stop` in an object list, and only the
    other ranks take the list's value: the same everywhere. Inside `if RANK != -1:` (DDP), whose
    other side is a single process."""
    src = """\
import os
RANK = int(os.getenv("RANK", -1))
stop = False
for epoch in range(100):
    for x, y in train:
        ((model(x) - y) ** 2).mean().backward()
    if RANK in {-1, 0}:
        stop = epoch > 50
    if RANK != -1:
        objs = [stop if RANK == 0 else None]
        dist.broadcast_object_list(objs, 0)
        if RANK != 0:
            stop = objs[0]
    if stop:
        break
"""
    assert found(src) == []
    # every rank computes its own verdict from its own loss first; rank 0's is the one sent
    own = """\
import os
RANK = int(os.getenv("RANK", -1))
for epoch in range(100):
    for x, y in train:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
    objs = [loss.item() < 0.1 if RANK == 0 else None]
    dist.broadcast_object_list(objs, 0)
    stop = loss.item() < 0.1
    if RANK != 0:
        stop = objs[0]
    if stop:
        break
"""
    assert found(own) == []
    assert [f[0] for f in found(own.replace("    if RANK != 0:\n        stop = objs[0]\n", ""))] == ["DD001"]
    # taken by rank 1 only: rank 2's own value stays, and differs
    assert [f[0] for f in found(src.replace("if RANK != 0:\n", "if RANK == 1:\n"))] == ["DD001"]
    # sent from rank 1, kept by rank 0: rank 0's own value is not what was sent
    assert [f[0] for f in found(src.replace("broadcast_object_list(objs, 0)", "broadcast_object_list(objs, 1)"))] \
        == ["DD001"]


def test_a_progress_bar_on_rank_0_and_a_rank_seeded_loader_generator_keep_the_loop_uniform():
    assert found("""\
import os
RANK = int(os.getenv("RANK", -1))
g = torch.Generator()
g.manual_seed(1234 + RANK)
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False), generator=g,
                    num_workers=RANK + 1)
pbar = enumerate(loader)
if RANK in {-1, 0}:
    pbar = tqdm(pbar, total=len(loader))
for i, (x, y) in pbar:
    ((model(x) - y) ** 2).mean().backward()
""") == []
