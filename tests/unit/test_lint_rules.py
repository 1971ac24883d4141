"""`ddpdoctor lint`, in process, on small source snippets: each rule's true positives and the
intended patterns that must stay quiet. No torch import, no process group: the linter only parses."""

from __future__ import annotations

import textwrap

import pytest

from ddpdoctor.lint import condition_is_rank_dependent
from ddpdoctor.lint.config import LintConfig
from ddpdoctor.lint.engine import lint_modules
from ddpdoctor.source.units import Module

HEAD = "import os, sys, random\nimport torch\nimport torch.distributed as dist\nimport torch.nn as nn\n" \
       "from torch.nn.parallel import DistributedDataParallel as DDP\n" \
       "from torch.utils.data import DataLoader, random_split\n" \
       "from torch.utils.data.distributed import DistributedSampler\n"
N_HEAD = HEAD.count("\n")


def lint(src: str, files: dict[str, str] | None = None, **cfg):
    """Findings for one snippet (HEAD prepended; lines are given relative to the snippet)."""
    mods = [Module("snippet.py", HEAD + textwrap.dedent(src))]
    for name, text in (files or {}).items():
        mods.append(Module(name, HEAD + textwrap.dedent(text)))
    findings, notes, _n = lint_modules(mods, LintConfig(**cfg))
    assert not notes, notes
    return findings


def found(src: str, **kw) -> list[tuple[str, str, int]]:
    """(id, severity, primary line relative to the snippet's first line = 1)."""
    return [(f.id, f.severity, f.locations[0].line - N_HEAD) for f in lint(src, **kw)]


def errors(src: str, **kw):
    return [x for x in found(src, **kw) if x[1] == "error"]


# -- rank dependence (the public API) -------------------------------------------------------------

@pytest.mark.parametrize("src,line,state", [
    ("from torch.distributed import get_rank as gr\nif gr() == 0:\n    pass\n", 2, "yes"),
    ("import torch.distributed as d\nr = d.get_rank(group=None)\nwhile r > 0:\n    r -= 1\n", 3, "yes"),
    ("import os\nlr = int(os.environ['LOCAL_RANK'])\nif lr:\n    pass\n", 3, "yes"),
    ("import os\nddp = int(os.environ.get('RANK', -1)) != -1\nif ddp:\n    pass\n", 3, "no"),
    ("import os\nif 'RANK' in os.environ:\n    pass\n", 2, "no"),
    ("import torch.distributed as dist\nw = dist.get_world_size()\nif w > 1:\n    pass\n", 3, "no"),
    ("import os\nif int(os.environ['SLURM_PROCID']) == 0:\n    pass\n", 2, "yes"),
    ("def f(accelerator):\n    if accelerator.is_main_process:\n        pass\n", 2, "yes"),
    ("def f(trainer):\n    if trainer.is_global_zero:\n        pass\n", 2, "yes"),
    ("def f(args):\n    if args.local_rank == 0:\n        pass\n", 2, "yes"),
    ("x = 1\nif x:\n    pass\n", 2, "no"),
    ("x = 1\n", 1, "unknown"),
    ("if (:\n", 1, "unknown"),
])
def test_condition_is_rank_dependent(src, line, state):
    v = condition_is_rank_dependent(src, line)
    assert v.state == state, v
    assert v.reason


def test_rank_dependence_flows_through_helpers_attributes_spawn_and_control():
    src = textwrap.dedent("""\
        import os
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        def is_main_process():
            return dist.get_rank() == 0

        class Trainer:
            def __init__(self):
                self.gpu_id = int(os.environ["LOCAL_RANK"])
            def train(self):
                if self.gpu_id == 0:
                    pass

        def worker(proc, world):
            if proc == 0:
                pass
            ckpt = None
            if proc == 0:
                ckpt = "/tmp/x"
            if ckpt:
                pass
            box = [ckpt]
            dist.broadcast_object_list(box, src=0)
            if box[0]:
                pass
            flag = torch.tensor([float(proc)])
            dist.all_reduce(flag)
            if flag.item() > 0:
                pass

        def main():
            if is_main_process():
                pass
            mp.spawn(worker, args=(2,), nprocs=2)
        """)
    lines = src.splitlines()

    def at(text):
        return lines.index(text) + 1

    assert condition_is_rank_dependent(src, at("        if self.gpu_id == 0:")).state == "yes"
    assert condition_is_rank_dependent(src, at("    if proc == 0:")).state == "yes"  # mp.spawn's rank
    assert condition_is_rank_dependent(src, at("    if ckpt:")).state == "yes"  # assigned under rank
    assert condition_is_rank_dependent(src, at("    if box[0]:")).state == "no"  # broadcast
    assert condition_is_rank_dependent(src, at("    if flag.item() > 0:")).state == "no"  # all-reduced
    v = condition_is_rank_dependent(src, at("    if is_main_process():"))
    assert v.state == "yes" and "get_rank" in v.reason


def test_for_iterables_and_conditional_expressions():
    src = ("import torch.distributed as dist\n"
           "r = dist.get_rank()\n"
           "for x in range(r):\n"
           "    pass\n"
           "y = 1 if r == 0 else 2\n"
           "for z in range(3):\n"
           "    pass\n")
    assert condition_is_rank_dependent(src, 3).state == "yes"
    assert condition_is_rank_dependent(src, 5).state == "yes"
    assert condition_is_rank_dependent(src, 6).state == "no"


def test_parameter_named_rank_without_callers_is_not_sure():
    v = condition_is_rank_dependent("def f(rank):\n    if rank == 0:\n        pass\n", 2)
    assert v.state == "yes" and not v.sure


# -- the structural rule ----------------------------------------------------------------------------

def test_collective_under_rank_condition_is_an_error_at_its_line():
    got = found("""\
        rank = dist.get_rank()
        x = torch.ones(2)
        if rank == 0:
            dist.all_reduce(x)
        dist.barrier()
        """)
    assert ("DD001", "error", 4) in got


def test_same_sequence_on_both_paths_is_quiet():
    assert not found("""\
        rank = dist.get_rank()
        if rank == 0:
            obj = [1]
            dist.broadcast_object_list(obj, src=0)
        else:
            obj = [None]
            dist.broadcast_object_list(obj, src=0)
        dist.barrier()
        """)


def test_rank0_logging_and_saving_then_barrier_is_quiet():
    assert not found("""\
        rank = dist.get_rank()
        model = DDP(nn.Linear(2, 2))
        if rank == 0:
            print("epoch done")
            torch.save(model.module.state_dict(), "ckpt.pt")
        dist.barrier()
        state = torch.load("ckpt.pt")
        """)


def test_p2p_pipeline_and_subgroup_members_are_quiet():
    assert not found("""\
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = [dist.new_group([r]) for r in range(world)]
        if rank == 0:
            dist.send(torch.ones(2), dst=1)
        elif rank == 1:
            buf = torch.empty(2)
            dist.recv(buf, src=0)
        members = [0, 1]
        if rank in members:
            dist.all_reduce(torch.ones(1), group=groups[rank])
        dist.barrier()
        """)


def test_correlated_conditions_are_simulated_rank_by_rank():
    # "the first process prepares, the others wait": two barriers under opposite conditions
    assert not found("""\
        def prepare(args):
            if args.local_rank not in [-1, 0]:
                dist.barrier()
            data = list(range(10))
            if args.local_rank == 0:
                dist.barrier()
            return data
        """)
    # the same shape, but ranks 8 and up never reach the second barrier
    assert ("DD001", "error", 6) in found("""\
        def prepare(args):
            if args.local_rank != 0:
                dist.barrier()
            data = list(range(10))
            if args.local_rank == 0 or args.local_rank >= 8:
                dist.barrier()
            return data
        """)


def test_early_exit_decided_from_an_all_reduced_value_is_quiet():
    assert not found("""\
        rank = dist.get_rank()
        loss = 1.0
        for step in range(10):
            dist.all_reduce(torch.ones(1))
            loss *= 0.5 if rank == 0 else 0.8
            stop = torch.tensor([1.0 if loss < 0.2 else 0.0])
            dist.all_reduce(stop)
            if stop.item() > 0:
                break
        dist.barrier()
        """)


def test_early_exit_on_a_local_value_skips_the_loops_collective():
    got = found("""\
        rank = dist.get_rank()
        loss = 1.0
        for step in range(10):
            dist.all_reduce(torch.ones(1))
            loss *= 0.5 if rank == 0 else 0.8
            if loss < 0.2:
                break
        dist.barrier()
        """)
    assert ("DD001", "error", 6) in got


def test_rank_dependent_return_and_exit_skip_later_collectives():
    assert ("DD001", "error", 3) in found("""\
        def step(rank):
            dist.all_reduce(torch.ones(1))
            if dist.get_rank() != 0:
                return
            dist.barrier()
        """)
    assert ("DD008", "error", 2) in found("""\
        rank = dist.get_rank()
        if rank == 1:
            sys.exit(0)
        dist.barrier()
        """)


def test_interprocedural_helper_that_communicates():
    got = lint("""\
        from helpers import sync_metrics, is_main_process
        if is_main_process():
            sync_metrics()
        dist.barrier()
        """, files={"helpers.py": """\
        def is_main_process():
            return dist.get_rank() == 0

        def _reduce(t):
            dist.all_reduce(t)

        def sync_metrics():
            _reduce(torch.zeros(1))
        """})
    assert [(f.id, f.severity) for f in got] == [("DD001", "error")]
    assert "sync_metrics()" in got[0].message and "all_reduce" in got[0].message


def test_ddp_forward_under_rank_condition_depends_on_buffers():
    buffered = found("""\
        rank = dist.get_rank()
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
        if rank == 0:
            model(torch.randn(2, 4))
        dist.barrier()
        """)
    assert ("DD001", "error", 4) in buffered
    assert not found("""\
        rank = dist.get_rank()
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
        if rank == 0:
            with torch.no_grad():
                model(torch.randn(2, 4))
            model.module(torch.randn(2, 4))
        dist.barrier()
        """)
    unknown = found("""\
        from mymodels import Net
        rank = dist.get_rank()
        model = DDP(Net())
        if rank == 0:
            model(torch.randn(2, 4))
        dist.barrier()
        """)
    assert unknown == [("DD001", "warning", 5)]
    assert not found("""\
        from mymodels import Net
        rank = dist.get_rank()
        model = DDP(Net(), broadcast_buffers=False)
        if rank == 0:
            model(torch.randn(2, 4))
        """)


def test_ddp_forward_of_a_user_model_judged_by_what_it_builds():
    src = """\
        class Block(nn.Module):
            def __init__(self, n, cfg):
                super().__init__()
                self.cfg = cfg
                self.fc = nn.Linear(n, n)
                self.norm = {norm}
                self.apply(self._init)

            def _init(self, m):
                pass

        class Net(nn.Module):
            def __init__(self, cfg):
                super().__init__()
                self.blocks = nn.ModuleList([Block(4, cfg) for _ in range(2)])

        rank = dist.get_rank()
        model = DDP(Net(None))
        if rank == 0:
            with torch.no_grad():
                model(torch.randn(2, 4))
        dist.barrier()
        """
    assert not found(src.format(norm="nn.LayerNorm(n)"))
    assert found(src.format(norm="nn.BatchNorm1d(n)")) == [("DD001", "error", 21)]
    assert found(src.format(norm="nn.BatchNorm1d(n) if cfg else nn.LayerNorm(n)")) == [("DD001", "warning", 21)]


def test_accelerate_and_lightning_spellings():
    got = found("""\
        from accelerate import Accelerator
        import pytorch_lightning as pl
        accelerator = Accelerator()
        model = nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        if accelerator.is_main_process:
            model(torch.randn(2, 4))
            optimizer.step()
            print("saved")
        if accelerator.is_local_main_process:
            preds = accelerator.gather(torch.ones(1))
        accelerator.wait_for_everyone()

        class Lit(pl.LightningModule):
            def validation_step(self, batch, idx):
                if self.global_rank == 0:
                    self.log("a", 1.0, sync_dist=True)
                    self.log("b", 1.0)
                self.log("c", 1.0, sync_dist=True)
        """)
    # the prepared model is buffer-free: its forward does not communicate
    assert got == [("DD001", "error", 12), ("DD001", "error", 18)]


def test_rank_dependent_trip_count():
    assert ("DD001", "error", 3) in found("""\
        rank = dist.get_rank()
        x = torch.ones(1)
        for _ in range(rank + 1):
            dist.all_reduce(x)
        """)
    uneven = """\
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DDP(nn.Linear(8, 1))
        data = torch.randn(9, 8)
        for x in data[rank::world]:
            model(x).sum().backward()
        """
    assert found(uneven) == [("DD006", "warning", 4)]
    assert not found("""\
        from torch.distributed.algorithms.join import Join
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DDP(nn.Linear(8, 1))
        data = torch.randn(9, 8)
        with Join([model]):
            for x in data[rank::world]:
                model(x).sum().backward()
        """)


def test_raise_in_a_helper_under_rank_condition():
    src = """\
        def load(rank, step):
            if rank == 1 and step == 2:
                raise ValueError("corrupt")
            return torch.ones(1)

        rank = dist.get_rank()
        for step in range(4):
            {call}
            dist.all_reduce(x)
        """
    assert found(src.format(call="x = load(rank, step)")) == [("DD008", "warning", 3)]
    caught = "try:\n                x = load(rank, step)\n            except ValueError:\n                x = torch.zeros(1)"
    assert not found(src.format(call=caught))


def test_name_only_rank_is_a_warning_and_configured_names_count():
    assert found("""\
        def body(rank):
            if rank == 0:
                dist.barrier()
        """) == [("DD001", "warning", 3)]
    src = """\
        def body(me, comm):
            if me.leader:
                comm.sync_all()
            comm.sync_all()
        """
    assert not found(src)
    assert found(src, rank_names=["leader"], communicating_functions=["sync_all"]) == [("DD001", "error", 3)]


# -- the other rules --------------------------------------------------------------------------------

def test_dd003_missing_barrier():
    src = """\
        rank = dist.get_rank()
        model = nn.Linear(2, 2)
        path = "/tmp/ckpt.pt"
        if rank == 0:
            torch.save(model.state_dict(), path)
        {between}
        model.load_state_dict(torch.load(path))
        """
    assert found(src.format(between="")) == [("DD003", "error", 7)]
    assert not found(src.format(between="dist.barrier()"))
    assert not found("""\
        rank = dist.get_rank()
        if rank == 0:
            torch.save({}, f"state-{rank}.pt")
        state = torch.load(f"state-{rank}.pt")  # every rank its own file
        """)
    assert found("""\
        rank = dist.get_rank()
        if rank == 0:
            torch.save({}, "c.pt")
        else:
            while not os.path.exists("c.pt"):
                pass
        """) == [("DD003", "error", 5)]


def test_dd004_seeds():
    assert found("""\
        rank = dist.get_rank()
        torch.manual_seed(rank)
        train, val = random_split(range(10), [8, 2])
        """) == [("DD004", "error", 3)]
    assert found("""\
        train, val = random_split(range(10), [8, 2])
        """) == [("DD004", "warning", 1)]
    assert not found("""\
        rank = dist.get_rank()
        torch.manual_seed(1234)
        train, val = random_split(range(10), [8, 2], generator=torch.Generator().manual_seed(0))
        model = DDP(nn.Linear(4, 1))
        aug = torch.Generator().manual_seed(1000 + rank)
        noise = torch.randn(3, generator=aug)
        torch.manual_seed(1337 + rank)
        net = nn.Linear(4, 1)
        net = DDP(net)
        """)
    assert found("""\
        rank = dist.get_rank()
        torch.manual_seed(rank)
        head = nn.Linear(4, 1)
        """) == [("DD004", "error", 3)]
    user_module = """\
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = {layer}

        rank = dist.get_rank()
        torch.manual_seed(rank)
        criterion = nn.CrossEntropyLoss()
        head = Head()
        """
    assert found(user_module.format(layer="nn.Linear(4, 1)")) == [("DD004", "error", 9)]
    assert not found(user_module.format(layer="nn.ReLU()"))  # nothing random to initialise


def test_dd005_manual_allreduce_of_ddp_gradients():
    src = """\
        model = {ctor}
        model(torch.randn(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        """
    assert found(src.format(ctor="DDP(nn.Linear(4, 2))")) == [("DD005", "error", 4)]
    assert not found(src.format(ctor="nn.Linear(4, 2)"))


def test_dd007_sampler():
    src = """\
        ds = range(10)
        sampler = DistributedSampler(ds{shuffle})
        loader = DataLoader(ds, sampler=sampler)
        for epoch in range(3):
            {set_epoch}
            for batch in loader:
                pass
        """
    assert found(src.format(shuffle="", set_epoch="pass")) == [("DD007", "warning", 6)]
    assert not found(src.format(shuffle="", set_epoch="sampler.set_epoch(epoch)"))
    assert not found(src.format(shuffle=", shuffle=False", set_epoch="pass"))
    assert found("""\
        ds = range(10)
        loader = DataLoader(ds, sampler=DistributedSampler(ds), shuffle=True)
        """) == [("DD007", "error", 2)]


def test_dd012_misuse():
    assert found("""\
        def cleanup():
            dist.destroy_process_group()

        dist.all_reduce(torch.ones(1))
        cleanup()
        dist.all_reduce(torch.ones(1))
        """) == [("DD012", "error", 6)]
    assert found("""\
        rank = dist.get_rank()
        g = dist.new_group([rank])
        """) == [("DD012", "error", 2)]
    assert not found("""\
        world = dist.get_world_size()
        groups = [dist.new_group([r]) for r in range(world)]
        dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
        """)
    assert found("""\
        model = DDP(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        """) == [("DD014", "error", 2)]


def test_dd002_rank_dependent_size():
    assert found("""\
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = len(range(rank, 1999, world))
        scores = torch.rand(mine)
        dist.all_reduce(scores)
        """) == [("DD002", "warning", 4)]
    assert not found("""\
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = len(range(rank, 1999, world))
        size = torch.tensor([mine])
        dist.all_reduce(size)
        padded = torch.zeros(int(size.item()))
        dist.all_reduce(padded)
        grad = torch.full((4,), float(rank))
        dist.all_reduce(grad)
        """)


def test_dd010_barrier_every_step():
    src = """\
        model = DDP(nn.Linear(8, 1))
        for epoch in range(2):
            {per_epoch}
            for step in range(5):
                {per_step}
                model(torch.randn(4, 8)).sum().backward()
        """
    assert found(src.format(per_epoch="pass", per_step="dist.barrier()")) == [("DD010", "info", 5)]
    assert not found(src.format(per_epoch="dist.barrier()", per_step="pass"))


def test_dd011_point_to_point_counts():
    src = """\
        CHUNKS = 3
        rank = dist.get_rank()
        if rank == 0:
            for i in range(CHUNKS):
                dist.send(torch.ones(4), dst=1)
        else:
            for _ in range({n}):
                buf = torch.empty(4)
                dist.recv(buf, src=0)
        """
    assert found(src.format(n="CHUNKS - 1")) == [("DD011", "error", 5)]
    assert not found(src.format(n="CHUNKS"))  # matches with 2 ranks: the program may be meant for 2
    assert not found("""\
        rank, world = dist.get_rank(), dist.get_world_size()
        for _micro in range(4):
            if rank == 0:
                dist.send(torch.randn(2, 4), dst=1)
                g = torch.empty(2, 4)
                dist.recv(g, src=1)
            elif rank == 1:
                a = torch.empty(2, 4)
                dist.recv(a, src=0)
                dist.send(a * 2, dst=0)
        right = torch.empty(2)
        if rank % 2 == 0:
            dist.send(torch.ones(2), dst=(rank + 1) % world)
            dist.recv(right, src=(rank + 1) % world)
        else:
            dist.recv(right, src=(rank - 1) % world)
            dist.send(torch.ones(2), dst=(rank - 1) % world)
        """)


# -- suppression --------------------------------------------------------------------------------

def test_suppression_comment():
    src = """\
        rank = dist.get_rank()
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # ddpdoctor: ignore[{ids}] rank 0 only: a subgroup of one
        """
    assert not found(src.format(ids="DD001"))
    assert not found(src.format(ids="divergent-collectives"))
    assert found(src.format(ids="DD003")) == [("DD001", "error", 3)]


def test_unparsable_and_odd_code_never_raises():
    odd = """\
        rank = dist.get_rank()
        match rank:
            case 0:
                dist.barrier()
        async def f():
            async with x as y:
                await dist.barrier()
        lam = lambda r=rank: dist.barrier() if r else None
        class C:
            x = dist.get_rank()
            def m(self):
                return self.x.y.z(*[], **{})
        """
    found(odd)  # no exception


def test_absurdly_deep_code_is_skipped_with_a_note(tmp_path):
    from ddpdoctor.lint import lint as lint_paths

    for n in (600, 3000):  # deep enough for the analysis, or even for Python's parser
        (tmp_path / f"deep{n}.py").write_text(HEAD + "rank = dist.get_rank()\nx = " + " + ".join(["rank"] * n)
                                              + "\nif x:\n    dist.barrier()\n")
    (tmp_path / "ok.py").write_text(HEAD + "rank = dist.get_rank()\nif rank == 0:\n    dist.barrier()\n")
    res = lint_paths([str(tmp_path)])
    assert any("ok.py" in f.locations[0].file and f.id == "DD001" for f in res.findings)
    assert any("deep3000.py" in n for n in res.notes), res.notes


def test_settings_without_a_toml_reader_fall_back_with_a_note(tmp_path, monkeypatch):
    import sys

    from ddpdoctor.lint.config import load_config

    p = tmp_path / "pyproject.toml"
    p.write_text('[tool.ddpdoctor.lint]\nrank-names = ["leader"]\n')
    assert load_config(str(p)).rank_names == ["leader"]
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.9/3.10
    cfg = load_config(str(p))
    assert cfg.rank_names == [] and "needs Python 3.11" in cfg.notes[0]


def test_dd013_parameters_changed_on_some_ranks_after_wrapping():
    # rank 0 re-initialises a layer after DDP's broadcast, then every rank trains
    assert found("""\
        rank = dist.get_rank()
        model = DDP(net)
        if rank == 0:
            nn.init.xavier_uniform_(net[0].weight)
        for x in loader:
            model(x).sum().backward()
        """) == [("DD013", "error", 4)]
    assert found("""\
        rank = dist.get_rank()
        model = DDP(net)
        if rank == 0:
            model.module.load_state_dict(ckpt)
        for x in loader:
            model(x).sum().backward()
        """) == [("DD013", "error", 4)]
    # changed before wrapping (DDP broadcasts rank 0's values), on every rank, repaired by a
    # broadcast, or at the end of training: quiet
    assert not [f for f in found("""\
        rank = dist.get_rank()
        if rank == 0:
            model.load_state_dict(ckpt)
        model = DDP(model)
        with torch.no_grad():
            model.module[0].weight.normal_()
        for x in loader:
            model(x).sum().backward()
        """) if f[0] == "DD013"]
    assert not [f for f in found("""\
        rank = dist.get_rank()
        model = DDP(net)
        if rank == 0:
            model.module.load_state_dict(ckpt)
        for p in model.parameters():
            dist.broadcast(p.data, 0)
        for x in loader:
            model(x).sum().backward()
        """) if f[0] == "DD013"]
    assert not [f for f in found("""\
        rank = dist.get_rank()
        model = DDP(net)
        for x in loader:
            model(x).sum().backward()
        if rank == 0:
            model.module.load_state_dict(best)
        """) if f[0] == "DD013"]
