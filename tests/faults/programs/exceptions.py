"""Fault-matrix program: exceptions from every kind of call, caught and printed one per line.

    E <case> <exception type> | <message> | context=<type> cause=<type> from_ddpdoctor=<bool>

Run with torchrun (2 ranks, gloo, 3 s process-group timeout). The untraced and the traced run
must print the same lines (after masking ports and pids) and exit with the same status.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def say(line):
    os.write(1, (line + "\n").encode())  # one write: ranks share the pipe


def describe(case, exc):
    chain = [exc.__context__, exc.__cause__]
    ours = any(c is not None and "ddpdoctor" in "".join(
        f.filename for f in __import__("traceback").extract_tb(c.__traceback__)) for c in chain)
    msg = " ".join(str(exc).split())[:300]
    say(f"E r{os.environ.get('RANK')} {case} {type(exc).__name__} | {msg} | context={type(exc.__context__).__name__} "
        f"cause={type(exc.__cause__).__name__} from_ddpdoctor={ours}")


def attempt(case, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every exception is the point
        describe(case, exc)
    else:
        say(f"E r{os.environ.get('RANK')} {case} returned")


def main():
    t = torch.ones(4)
    attempt("before_init_all_reduce", lambda: dist.all_reduce(t))
    attempt("before_init_barrier", lambda: dist.barrier())
    attempt("before_init_get_rank", lambda: dist.get_rank())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    attempt("bad_op", lambda: dist.all_reduce(t, op="bad"))
    attempt("unknown_keyword", lambda: dist.all_reduce(t, bogus=1))
    attempt("broadcast_src_str", lambda: dist.broadcast(t, src="a"))
    attempt("gather_dst_str", lambda: dist.gather(t, dst="z"))
    attempt("send_dst_str", lambda: dist.send(t, dst="one"))
    attempt("broadcast_object_list_int", lambda: dist.broadcast_object_list(5))
    attempt("scatter_object_list_int", lambda: dist.scatter_object_list(3, [1, 2]))
    attempt("all_gather_wrong_list", lambda: dist.all_gather([torch.ones(4)], t))
    attempt("invalid_group_object", lambda: dist.all_reduce(t, group=object()))
    sub = dist.new_group([0, 1])
    dist.destroy_process_group(sub)
    attempt("destroyed_group", lambda: dist.all_reduce(t, group=sub))
    dist.all_reduce(t)
    say(f"R rank {rank} sum {t.tolist()}")
    late = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))  # its own connections: the timeout breaks only this group
    # A timeout (rank 1 is late by more than the process-group timeout), then a dead peer
    # (rank 1 leaves without a word while rank 0 waits in the next call).
    if rank == 1:
        time.sleep(4.5)
        os._exit(3)
    attempt("timeout_all_reduce", lambda: dist.all_reduce(torch.ones(2), group=late))
    attempt("dead_peer_all_reduce", lambda: dist.all_reduce(torch.ones(2)))
    attempt("dead_peer_broadcast", lambda: dist.broadcast(torch.ones(2), src=1))
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        describe("destroy", exc)
    attempt("after_destroy_all_reduce", lambda: dist.all_reduce(t))
    attempt("after_destroy_barrier", lambda: dist.barrier())
    say("R rank 0 done")


def rank_main(rank, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    main()


if __name__ == "__main__":
    import multiprocessing as mp

    port = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    say(f"R exit codes {[p.exitcode for p in procs]}")
