"""What a rank that died in C++ left beside its trace: the call it was inside (the
memory-mapped in-flight file) and, from faulthandler, the fatal error and its stack."""

from __future__ import annotations

import os
import re

from ..trace.files import STACKS_SUFFIX, SUFFIX, open_regular
from .conform import parse_line

_FATAL = re.compile(r"^Fatal Python error: (.+)$", re.M)
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$', re.M)
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/ddpdoctor/", "/lib/python3", "<frozen")


def read_sidecars(rt, path: str) -> None:
    """What a rank that died in C++ left beside its trace: the call it was inside (the
    memory-mapped in-flight file) and, from faulthandler, the fatal error and its stack."""
    from ..trace import inflight as inflightfile

    base = path[: -len(SUFFIX)]
    line = inflightfile.read(base + inflightfile.SUFFIX)
    if line:
        try:
            rec = parse_line(line.encode("utf-8", "replace"))
        except (ValueError, RecursionError):
            rec = None
        if isinstance(rec, dict) and rec.get("t") == "c" and isinstance(rec.get("s"), int):
            gs = rt.groups.get(rec.get("g", "0"))
            if rec["s"] > (gs.count if gs is not None else 0):
                rt.rare.append(dict(rec, t="pending", src="inflight"))
        elif isinstance(rec, dict) and rec.get("t") == "stopped":
            # outfault: the rank could not write its trace any more and ran on untraced
            rt.output_fault = rec
            ex = rec.get("exit")
            if isinstance(ex, dict) and ex.get("t") == "exit" and rt.exit_record() is None:
                rt.rare.append(dict(ex, src="inflight"))
    if rt.exit_record() is not None:
        return
    try:
        with open_regular(base + STACKS_SUFFIX) as f:
            size = os.fstat(f.fileno()).st_size
            if size > 200000:
                f.seek(size - 200000)
            text = f.read(200000).decode("utf-8", "replace")
    except OSError:
        return
    fatal = list(_FATAL.finditer(text))
    if not fatal:
        return
    block = text[fatal[-1].start():]
    current = block.find("Current thread")
    frames = _FRAME.findall(block[current:] if current >= 0 else block)
    user = next((f for f in frames if not any(p in f[0] for p in _LIBRARY_PARTS)), None)
    rec = {"t": "exit", "how": "crash", "exc": f"Fatal Python error: {fatal[-1].group(1).strip()}",
           "ts": rt.last_ts, "src": "faulthandler"}
    if user:
        rec.update(file=user[0], line=int(user[1]), func=user[2].strip())
    rt.rare.append(rec)
