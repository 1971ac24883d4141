"""A traced call that fails must fail exactly as it does untraced (issue #16).

The user's call is issued exactly once; its exception propagates once, with the same type and
message, and nothing of ddpdoctor's in ``__context__``/``__cause__``; an argument ddpdoctor
cannot describe (``broadcast(src="a")``) is recorded without that field, never turned into an
error of ddpdoctor's chained to the user's. Real gloo process groups, short timeouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import PY, ROOT, free_port, read_records, run_bounded

# Runs each bad call twice in one process: untraced, then with ddpdoctor patched in (in-process
# activation wraps whatever c10d holds, here a counting shim around torch's function), and
# prints what happened as JSON.
SCRIPT = textwrap.dedent(r'''
    import datetime, functools, json, os, re, sys
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    calls = {}
    for name in ("all_reduce", "broadcast", "gather", "send", "broadcast_object_list",
                 "scatter_object_list"):
        orig = getattr(c10d, name)

        def shim(*a, _orig=orig, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a, **k)

        shim = functools.wraps(orig)(shim)
        setattr(c10d, name, shim)
        setattr(dist, name, shim)

    def outcome(fn):
        try:
            fn()
        except Exception as exc:
            chain, e = [], exc
            while e.__context__ is not None or e.__cause__ is not None:
                e = e.__cause__ or e.__context__
                tb = e.__traceback__
                files = []
                while tb is not None:
                    files.append(tb.tb_frame.f_code.co_filename)
                    tb = tb.tb_next
                chain.append([type(e).__name__, files])
            msg = re.sub(r"0x[0-9a-f]+", "0x?", str(exc))[:300]  # object addresses differ
            return {"type": type(exc).__name__, "msg": msg, "chain": chain}
        return {"type": None}

    t = torch.ones(1)
    if mode == "bad-args":
        cases = {
            "all_reduce_band": lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND),
            "broadcast_src": lambda: dist.broadcast(t, src="a"),
            "gather_dst": lambda: dist.gather(t, dst="z"),
            "send_dst": lambda: dist.send(t, dst="one"),
            "broadcast_object_list": lambda: dist.broadcast_object_list(5),
            "scatter_object_list": lambda: dist.scatter_object_list(3, [1]),
        }
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=20))
        plain = {k: outcome(f) for k, f in cases.items()}
        plain_calls = dict(calls)
        calls.clear()
        dist.destroy_process_group()
        from ddpdoctor.rank import activate
        activate.activate_in_process()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=20))
        traced = {k: outcome(f) for k, f in cases.items()}
        dist.all_reduce(t)  # recording still works after the failures
        print(json.dumps({"plain": plain, "traced": traced, "plain_calls": plain_calls,
                          "traced_calls": calls}))
        dist.destroy_process_group()
    else:  # timeout: rank 1 never joins rank 0's all_reduce
        from ddpdoctor.rank import activate
        activate.activate_in_process()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=3))
        if rank == 0:
            print(json.dumps({"outcome": outcome(lambda: dist.all_reduce(t)), "calls": calls}))
            sys.stdout.flush()
            os._exit(0)
        import time
        time.sleep(8)  # stays connected past rank 0's timeout, then leaves without a word
        os._exit(0)
''')


def _env(out) -> dict:
    import os

    env = dict(os.environ)
    env.update({"DDPDOCTOR_OUT": str(out), "DDPDOCTOR_HANG_TIMEOUT": "0", "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1"})
    return env


def _no_ddpdoctor_frames(chain: list) -> bool:
    return not any("/ddpdoctor/" in f for _, files in chain for f in files)


def test_bad_arguments_fail_as_untraced(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    out = tmp_path / "trace"
    res = run_bounded([PY, str(script), "0", "1", str(free_port()), "bad-args"], timeout=120, env=_env(out))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert "internal error" not in res.stderr, res.stderr
    for case, plain in doc["plain"].items():
        traced = doc["traced"][case]
        assert plain["type"] is not None, f"{case}: expected torch to reject it"
        assert (traced["type"], traced["msg"]) == (plain["type"], plain["msg"]), case
        assert len(traced["chain"]) == len(plain["chain"]), (case, traced["chain"])
        assert _no_ddpdoctor_frames(traced["chain"]), (case, traced["chain"])
    # each call reached torch exactly once, as untraced
    assert doc["traced_calls"].pop("all_reduce") == doc["plain_calls"]["all_reduce"] + 1  # + the good one
    assert doc["traced_calls"] == {k: v for k, v in doc["plain_calls"].items() if k != "all_reduce"}
    recs = read_records(out, 0)
    failed = [r for r in recs if r.get("t") in ("c", "p") and "err" in r]
    assert {r["op"] for r in failed} >= {"all_reduce", "broadcast", "gather", "send"}, failed
    bcast = next(r for r in failed if r["op"] == "broadcast")
    assert "root" not in bcast  # src="a" is left out, not guessed
    assert any(r.get("t") == "c" and r["op"] == "all_reduce" and "err" not in r for r in recs)


def test_timeout_propagates_once_unchanged(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    env = _env(tmp_path / "trace")
    procs = [subprocess.Popen([PY, str(script), str(r), "2", port, "timeout"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    out0, err0 = outs[0]
    assert procs[0].returncode == 0, out0 + err0
    doc = json.loads(out0.strip().splitlines()[-1])
    o = doc["outcome"]
    assert o["type"] is not None
    assert "timed out" in o["msg"].lower() or "timeout" in o["msg"].lower(), o
    assert o["chain"] == [] or _no_ddpdoctor_frames(o["chain"]), o
    assert doc["calls"] == {"all_reduce": 1}, doc["calls"]
    assert "internal error" not in err0, err0


if __name__ == "__main__":
    sys.exit(subprocess.call([PY, "-m", "pytest", "-q", __file__]))
