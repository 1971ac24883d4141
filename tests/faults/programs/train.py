"""Fault-matrix program: a small DDP training run (torchrun, 2 ranks, gloo) whose results are
printed as ``R`` lines, with switches for the environment cells of the matrix.

    --steps N --sleep S          steps, and seconds slept in each (signal cells need a long run)
    --wait-before-init FILE      wait until FILE exists before init_process_group
    --wait-after-init FILE       wait until FILE exists after the first step
    --bwd-error                  step 2's backward raises inside DDP; the program catches it and
                                 goes on with plain collectives for a few seconds
    --self-patch                 the script wraps torch.distributed.all_reduce itself
    --threads                    two threads issue collectives on two different groups
    --fork                       fork a child after init (it computes, never communicates)
    --loader                     persistent DataLoader workers feed the steps
    --fail-first-attempt         rank 1 raises in the first torchrun attempt (--max-restarts)
    --helper                     import a module found through the user's own PYTHONPATH
    --linger                     after destroy_process_group rank 0 (the store's host) exits at
                                 once while rank 1 stays a few seconds longer
"""

import argparse
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def say(line):
    os.write(1, (line + "\n").encode())  # one write: ranks share the pipe


def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--wait-before-init")
    ap.add_argument("--wait-after-init")
    for flag in ("bwd-error", "self-patch", "threads", "fork", "loader", "fail-first-attempt", "helper",
                 "linger"):
        ap.add_argument(f"--{flag}", action="store_true")
    args, _ = ap.parse_known_args()
    if args.helper:
        import faultmatrix_helper  # found only through the PYTHONPATH the user set

        say(f"R helper {faultmatrix_helper.VALUE}")
    if args.self_patch:
        orig = dist.all_reduce
        calls = []

        def all_reduce(tensor, *a, **kw):  # the program's own wrapper, installed before init
            calls.append(1)
            return orig(tensor, *a, **kw)

        dist.all_reduce = all_reduce
    if args.fail_first_attempt and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        # Before any rank initialises: gloo in torch 2.13 often fails to connect again after a
        # restart of ranks that had (its stale store keys), with or without ddpdoctor.
        if os.environ.get("RANK") == "1":
            raise RuntimeError("first attempt fails on purpose")
        time.sleep(60)  # the other ranks wait to be stopped by torchrun
    if args.wait_before_init:
        wait_for(args.wait_before_init)
    timeout = float(os.environ.get("FAULT_PG_TIMEOUT", "20"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    say(f"P rank{rank} pid {os.getpid()}")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = None
    if args.loader:
        loader = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=2, persistent_workers=True,
                                             sampler=torch.utils.data.distributed.DistributedSampler(
                                                 Squares(), shuffle=False))
        batches = [b for _epoch in range(2) for b in loader]
    for step in range(args.steps):
        if batches is not None:
            x = batches[step % len(batches)]
        else:
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        if args.bwd_error and step == 1:
            first = next(iter(model.parameters()))
            h = first.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("bad gradient")))
            try:
                loss.backward()
            except RuntimeError as exc:
                say(f"R rank {rank} caught {exc}")
            h.remove()
            break
        loss.backward()
        opt.step()
        say(f"R rank {rank} step {step} loss {loss.item():.6f}")
        if step == 0 and args.wait_after_init:
            wait_for(args.wait_after_init)
        if args.sleep:
            time.sleep(args.sleep)
    if args.bwd_error:
        # plain collectives after the caught error, for longer than the hang timeout
        t = torch.ones(1)
        for _ in range(40):
            dist.all_reduce(t)
            time.sleep(0.2)
        say(f"R rank {rank} after error {t.item()}")
    if args.threads:
        groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
        sums = [None, None]

        def work(i):
            t = torch.full((4,), float(i + 1))
            for _ in range(20):
                dist.all_reduce(t, group=groups[i])
                t /= 2
            sums[i] = t.sum().item()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        say(f"R rank {rank} threads {sums}")
    if args.fork:
        pid = os.fork()
        if pid == 0:
            code = int(sum(p.detach().abs().sum().item() for p in model.parameters()) * 1000) % 200
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        say(f"R rank {rank} forked child exit {os.waitstatus_to_exitcode(status)}")
    if args.self_patch:
        t = torch.ones(2)
        dist.all_reduce(t)
        say(f"R rank {rank} self-patched calls {len(calls)} sum {t.tolist()}")
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    say(f"R rank {rank} final {checksum:.6f}")
    dist.destroy_process_group()
    if args.linger and rank == 1:
        time.sleep(4)
        say("R rank 1 lingered")


if __name__ == "__main__":
    main()
