"""A buggy 3-rank gloo job run WITHOUT ddpdoctor; each rank dumps PyTorch's Flight Recorder.

    python fr_job.py SCENARIO OUT_DIR [json]

Each rank starts a background thread that, once the main thread has been stuck in one place
for 1.5 s, writes ``torch._C._distributed_c10d._dump_fr_trace()`` to
``OUT_DIR/fr_trace_rank_<rank>`` (what NCCL's watchdog does on a timeout) while the main thread
hangs in its collective. The parent ends the workers once the dumps are written.
"""

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3
STUCK_S = 1.5
#: Set by the main thread where every rank arrives before the hang: a wait before that point
#: (a slow peer on a loaded machine) is not the hang.
ARMED = threading.Event()


def arm():
    ARMED.set()


def dumper(rank, out, form, main_ident):
    """Dump when the main thread has been stuck on one instruction for a while (what a
    collective timeout would do), and again if it later gets stuck somewhere else."""
    # torch's first dump in a process prepares stack symbolization for seconds (longer on a loaded
    # machine): do it now, while the job runs, so that the dump at the hang is quick
    torch._C._distributed_c10d._dump_fr_trace()
    ARMED.wait()
    last, since, dumped = None, time.time(), None
    while True:
        time.sleep(0.1)
        frame = sys._current_frames().get(main_ident)
        here = (frame.f_code, frame.f_lasti) if frame is not None else None
        if here != last:
            last, since = here, time.time()
            continue
        if time.time() - since < STUCK_S or dumped == here:
            continue
        dumped = here
        if form == "json":
            data, name = torch._C._distributed_c10d._dump_fr_trace_json(), f"fr_trace_rank_{rank}.json"
        else:
            data, name = torch._C._distributed_c10d._dump_fr_trace(), f"fr_trace_rank_{rank}"
        with open(os.path.join(out, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def divergent(rank, t):
    for _ in range(5):
        dist.all_reduce(t)
    arm()
    if rank == 0:
        dist.all_reduce(t)  # culprit: divergent (only rank 0 makes this call)
    dist.barrier()


def skipped_barrier(rank, t):
    for _ in range(4):
        dist.all_reduce(t)
    arm()
    if rank != 2:
        dist.barrier()
    dist.all_reduce(t)  # culprit: skipped_barrier (rank 2 skipped the barrier and waits here)


def mismatch(rank, t):
    dist.all_reduce(t)
    x = torch.ones(2, 4) if rank == 1 else torch.ones(8)
    dist.all_reduce(x)  # culprit: mismatch (rank 1 passes [2, 4], the others [8]; same bytes: gloo says nothing)
    dist.all_reduce(t)
    arm()
    dist.barrier()
    time.sleep(30)


def dead_rank(rank, t):
    for _ in range(3):
        dist.all_reduce(t)
    arm()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen like a dead node: sockets stay open, no dump
    dist.all_reduce(t)  # culprit: dead_rank (ranks 0 and 2 wait here for rank 1)


def uneven_ddp(rank, t):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    batches = [torch.randn(8, 4) for _ in range(3 if rank == 1 else 4)]
    for i, x in enumerate(batches):
        if i == len(batches) - 1:
            arm()
        loss = model(x).sum()
        loss.backward()  # ranks 0 and 2 wait in a gradient all-reduce rank 1 never joins
    dist.barrier()  # culprit: uneven_ddp (rank 1 ran out of batches)


def wrapped(rank, t):
    for _ in range(60):
        dist.all_reduce(t)
    arm()
    if rank == 0:
        dist.all_reduce(t)  # culprit: wrapped (only rank 0 makes this call)
    dist.barrier()


SCENARIOS = {f.__name__: f for f in (divergent, skipped_barrier, mismatch, dead_rank, uneven_ddp, wrapped)}


def worker(rank, scenario, out, form, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if scenario == "wrapped":  # ring buffers of different sizes, both too small for the job
        os.environ["TORCH_FR_BUFFER_SIZE"] = "20" if rank == 0 else "35"
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=150))
    threading.Thread(target=dumper, args=(rank, out, form, threading.get_ident()), daemon=True).start()
    SCENARIOS[scenario](rank, torch.ones(4))
    time.sleep(60)


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    form = sys.argv[3] if len(sys.argv) > 3 else "pickle"
    port = int(os.environ.get("FR_JOB_PORT", "29571"))
    os.makedirs(out, exist_ok=True)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker, args=(r, scenario, out, form, port), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    expect = [r for r in range(WORLD) if not (scenario == "dead_rank" and r == 1)]
    suffix = ".json" if form == "json" else ""
    deadline = time.time() + 140
    while time.time() < deadline:
        paths = [os.path.join(out, f"fr_trace_rank_{r}{suffix}") for r in expect]
        if all(os.path.exists(p) for p in paths) and time.time() - max(os.path.getmtime(p) for p in paths) > 3:
            break  # every dump written, none rewritten for 3 s (a rank stuck twice dumps twice)
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    missing = [r for r in expect if not os.path.exists(os.path.join(out, f"fr_trace_rank_{r}{suffix}"))]
    print("dumps missing:", missing, "exit codes:", [p.exitcode for p in procs], flush=True)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
