"""The test-suite API: ``ddpdoctor.check()``, ``ddpdoctor.spawn()`` and the pytest plugin, with
real ranks (gloo over loopback). Every launch is bounded by spawn's timeout or a subprocess
timeout, and by the process group's timeout (PG_TIMEOUT)."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from support.jobs import PY, ROOT, free_port

import ddpdoctor

PG_TIMEOUT = datetime.timedelta(seconds=20)
HANG_TIMEOUT = 4.0
SPAWN_TIMEOUT = 90


def _init() -> None:
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)  # spawn() set the environment


def _line_of(marker: str) -> int:
    """Line number of the source line of this file that carries a marker comment."""
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith("# " + marker):
            return i
    raise AssertionError(marker)


# -- rank functions (module level: they are pickled by reference into the children) ----------------

def divergent_worker(rank: int, world_size: int) -> None:
    _init()
    with ddpdoctor.check(hang_timeout=HANG_TIMEOUT):
        x = torch.ones(4)
        for _ in range(2):
            dist.all_reduce(x)
        if rank == 0:  # DIVERGENT-IF
            dist.all_reduce(torch.zeros(1))  # DIVERGENT-CALL
        dist.barrier()
    dist.destroy_process_group()


def ddp_double_allreduce_worker(rank: int, world_size: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddpdoctor.check(hang_timeout=10):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)  # DOUBLE-ALLREDUCE
            opt.step()
    dist.destroy_process_group()


class UserError(Exception):
    pass


def correct_worker(rank: int, world_size: int) -> None:
    """Data-parallel training by hand (no DDP, to keep the test cheap): the gradients are
    averaged explicitly, once, and a metric is all-reduced for logging."""
    _init()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # different data per rank
    with ddpdoctor.check(hang_timeout=10):
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
            opt.step()
            metric = loss.detach().clone()
            dist.all_reduce(metric)
        dist.barrier()
    # An exception of the block's own code comes out unchanged (the same object, no chaining).
    raised = UserError(f"mine on rank {rank}")
    try:
        with ddpdoctor.check(hang_timeout=10):
            dist.all_reduce(torch.ones(2))
            raise raised
    except UserError as caught:
        assert caught is raised and caught.__cause__ is None and caught.__context__ is None
    else:
        raise AssertionError("the user's exception was swallowed")
    dist.barrier()  # the process group still works after it
    dist.destroy_process_group()


def failing_rank_worker(rank: int, world_size: int) -> None:
    _init()
    with ddpdoctor.check(hang_timeout=10):
        dist.all_reduce(torch.ones(2))
        if rank == 1:
            raise UserError("boom from rank 1")  # RANK-RAISES
    dist.destroy_process_group()


def rop_mismatch_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """Launched by torch.multiprocessing.spawn or multiprocessing.Process: no ddpdoctor.spawn, so
    check() instruments the process itself. A mismatched reduce op completes silently in gloo."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=PG_TIMEOUT)
    try:
        with ddpdoctor.check(hang_timeout=10):
            x = torch.ones(4)
            dist.all_reduce(x)
            op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
            dist.all_reduce(x, op=op)  # ROP-MISMATCH
    except ddpdoctor.DistributedBugError as err:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"message": str(err), "categories": err.categories}, f)
        if out.endswith("-raise"):
            raise
    dist.destroy_process_group()


def backend_timeout_worker(rank: int, world_size: int, port: int) -> None:
    """No watchdog (hang_timeout=0) and a short process-group timeout: gloo's own timeout ends
    the mismatched calls, and check() replaces that error by the diagnosis, chained to it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=3))
    try:
        with ddpdoctor.check(hang_timeout=0):
            x = torch.ones(4)
            dist.all_reduce(x)
            if rank == 0:
                dist.all_reduce(torch.zeros(1))  # BACKEND-TIMEOUT
            dist.barrier()
    except ddpdoctor.DistributedBugError as err:
        assert isinstance(err.__cause__, RuntimeError), repr(err.__cause__)
        raise


# -- helpers ---------------------------------------------------------------------------------------

def _leftovers(err: ddpdoctor.DistributedBugError | None = None) -> list[str]:
    """Processes this test left behind: children of pytest (but multiprocessing's resource
    tracker, which lives as long as pytest) and anything carrying a spawn's environment."""
    me = psutil.Process()
    out = []
    for p in me.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in cmd:
            continue
        out.append(f"{p.pid} {cmd[:120]}")
    if err is not None and err.trace_dir:
        workdir = os.path.dirname(err.trace_dir)
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get("DDPDOCTOR_CHECK_DIR") == workdir:
                    out.append(f"{p.pid} carries {workdir}")
            except (psutil.Error, OSError):
                continue
    return out


_kept: list[str] = []


@pytest.fixture(autouse=True)
def _private_tmp(tmp_path, monkeypatch):
    """Ranks started by these tests keep their failure traces under tmp_path, not in /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    yield
    import shutil

    while _kept:
        shutil.rmtree(_kept.pop(), ignore_errors=True)


def _spawn_expecting_error(fn, **kw) -> tuple[ddpdoctor.DistributedBugError, float]:
    t0 = time.monotonic()
    with pytest.raises(ddpdoctor.DistributedBugError) as info:
        ddpdoctor.spawn(fn, world_size=2, timeout=SPAWN_TIMEOUT, args=(2,), **kw)
    elapsed = time.monotonic() - t0
    assert info.value.trace_dir and os.path.isdir(info.value.trace_dir)
    _kept.append(os.path.dirname(info.value.trace_dir))
    assert not _leftovers(info.value), _leftovers(info.value)
    return info.value, elapsed


# -- spawn + check ---------------------------------------------------------------------------------

def test_divergent_branch_fails_fast_with_the_culprit_line():
    err, elapsed = _spawn_expecting_error(divergent_worker)
    msg = str(err)
    this = os.path.basename(__file__)
    # The hang diagnosis and the divergence finding both name the culprit's lines.
    assert err.hang and "HANG" in err.hang, msg
    assert f"{this}:{_line_of('DIVERGENT-CALL')}" in err.hang, err.hang
    assert "divergent-collectives" in err.categories, msg
    div = next(f for f in err.findings if f.category == "divergent-collectives")
    assert div.ranks == [0], div
    lines = {(os.path.basename(loc.file), loc.line) for loc in div.locations}
    assert (this, _line_of("DIVERGENT-CALL")) in lines and (this, _line_of("DIVERGENT-IF")) in lines
    assert f"{this}:{_line_of('DIVERGENT-CALL')}" in msg and "fix:" in msg
    assert elapsed < SPAWN_TIMEOUT / 2, elapsed
    # Measured inside the rank (start-up excluded): from the stuck call to the rank's end.
    rank0 = [json.loads(line) for f in Path(err.trace_dir).glob("rank00000-*.jsonl")
             for line in f.read_text().splitlines() if line.startswith("{")]
    stuck = next(r for r in rank0 if r.get("t") == "pending")  # written by the watchdog
    end = next(r for r in rank0 if r.get("t") == "exit")
    assert end.get("how") == "hang-kill", end
    assert (end["ts"] - stuck["ts"]) / 1e6 < HANG_TIMEOUT + 5, (stuck, end)


def test_ddp_double_allreduce_fails_with_the_line():
    err, _ = _spawn_expecting_error(ddp_double_allreduce_worker)
    assert err.categories == ["ddp-manual-allreduce"], str(err)
    this = os.path.basename(__file__)
    assert f"{this}:{_line_of('DOUBLE-ALLREDUCE')}" in str(err)
    assert err.findings[0].ranks == [0, 1]
    assert err.hang is None and not err.rank_errors


def test_correct_training_passes_and_user_exceptions_come_out_unchanged():
    t0 = time.monotonic()
    assert ddpdoctor.spawn(correct_worker, world_size=2, timeout=SPAWN_TIMEOUT, args=(2,)) is None
    assert time.monotonic() - t0 < SPAWN_TIMEOUT
    assert not _leftovers()


def test_a_rank_exception_is_reported_with_its_traceback():
    err, _ = _spawn_expecting_error(failing_rank_worker)
    assert set(err.rank_errors) == {1}, err.rank_errors
    text = err.rank_errors[1]
    assert "UserError: boom from rank 1" in text and "Traceback" in text
    assert f"line {_line_of('RANK-RAISES')}, in failing_rank_worker" in text
    assert text in str(err)
    # Rank 0 finished the block; it explains that rank 1 did not.
    assert "rank-failed" in err.categories, str(err)


# -- check() without ddpdoctor.spawn ---------------------------------------------------------------

def test_check_under_torch_multiprocessing_spawn_explains_a_backend_error():
    import torch.multiprocessing as tmp

    t0 = time.monotonic()
    with pytest.raises(tmp.ProcessRaisedException) as info:
        tmp.spawn(backend_timeout_worker, args=(2, free_port()), nprocs=2, join=True)
    text = str(info.value)
    assert "DistributedBugError" in text and "divergent-collectives" in text, text
    assert f"test_testing_api.py:{_line_of('BACKEND-TIMEOUT')}" in text
    assert "collective raised: RuntimeError" in text  # the backend's error, kept in the message
    assert time.monotonic() - t0 < 60
    assert not _leftovers()


def test_check_under_plain_processes_raises_the_same_error_on_every_rank(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rop_mismatch_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    assert results[0]["categories"] == ["collective-mismatch"]
    assert "SUM" in results[0]["message"] and "MAX" in results[0]["message"]
    assert not _leftovers()


# -- pytest plugin, the example file, pytest under torchrun -----------------------------------------

FAILING_MARKER_TEST = '''
import datetime
import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def process_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.ddpdoctor(hang_timeout=10)
def test_mismatched_reduce_op(process_group):
    x = torch.ones(4)
    op = dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX
    dist.all_reduce(x, op=op)  # THE-BUG
'''


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", EXAMPLE_PG_TIMEOUT="20")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=env)


def test_plugin_loads_without_torch_and_check_needs_a_process_group():
    code = ("import sys, ddpdoctor.pytest_plugin, ddpdoctor\n"
            "assert 'torch' not in sys.modules and 'ddpdoctor.testing' not in sys.modules\n"
            "try:\n    ddpdoctor.check().__enter__()\nexcept RuntimeError as e:\n    print('OK', e)\n")
    res = _run([PY, "-c", code], timeout=60)
    assert res.returncode == 0 and "OK" in res.stdout and "init_process_group" in res.stdout, res


def test_example_file_passes_with_plain_pytest():
    res = _run([PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
                "examples/test_distributed_example.py"], timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 passed, 1 skipped" in res.stdout


def test_pytest_under_torchrun_with_the_marker(tmp_path):
    bad = tmp_path / "test_marker_failure.py"
    bad.write_text(textwrap.dedent(FAILING_MARKER_TEST))
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "pytest", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", "examples/test_distributed_example.py", str(bad)]
    res = _run(cmd, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]  # the failing test fails on both ranks
    # Every rank: the example's marker test passes, the spawn test is skipped, the bug fails.
    assert out.count("1 failed, 1 passed, 1 skipped") == 2, out[-4000:]
    # The failure text is ddpdoctor's report, not a traceback.
    assert "DistributedBugError (ddpdoctor)" in out, out[-4000:]
    line = next(i for i, s in enumerate(bad.read_text().splitlines(), 1) if s.endswith("# THE-BUG"))
    assert "collective-mismatch" in out and f"{bad.name}:{line}" in out, out[-4000:]


HANGING_MARKER_TEST = '''
import datetime
import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def process_group():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    yield
    dist.destroy_process_group()


@pytest.mark.ddpdoctor(hang_timeout=3)
def test_hangs(process_group):
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))  # THE-HANG
'''


def test_a_hang_under_torchrun_pytest_ends_the_ranks_and_prints_the_diagnosis(tmp_path):
    hang = tmp_path / "test_marker_hang.py"
    hang.write_text(textwrap.dedent(HANGING_MARKER_TEST))
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "pytest", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", str(hang)]
    t0 = time.monotonic()
    res = _run(cmd, timeout=120)  # the process group's own timeout is 20 s
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "exitcode: 124" in out, out[-4000:]
    assert time.monotonic() - t0 < 60
    # pytest captured the test's output, yet the diagnosis is shown, with the culprit's line.
    line = next(i for i, s in enumerate(hang.read_text().splitlines(), 1) if s.endswith("# THE-HANG"))
    assert "ddpdoctor: HANG" in out and f"{hang.name}:{line}" in out, out[-4000:]
    assert "culprit: rank 0" in out, out[-4000:]
