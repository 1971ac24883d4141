"""Python's ``random`` and NumPy's global generator, for the unseeded-rng check.

Two kinds of records, both off the training path:

* ``seed`` (``gen`` ``python`` / ``numpy`` / ``numpy_rng``): every ``random.seed`` and
  ``numpy.random.seed`` call, with its value, like ``torch.manual_seed``'s, and the
  ``numpy.random.default_rng(seed)`` calls of the set-up window.
* ``rng``: the draws from the global generators made while the program sets up (``op`` ``draw``:
  a digest of the input and of the result, so that ranks shuffling the same list differently show
  up), and the end of that set-up window (``op`` ``end``). The window closes at the first module
  forward, ``DataLoader`` iteration or optimizer step, whichever comes first; the wrappers are then
  taken out of ``random`` / ``numpy.random`` again, so that per-step randomness (augmentation,
  dropout decisions) costs nothing and is never recorded.
"""

from __future__ import annotations

import functools
import random
import threading
import zlib

from .. import recorder as recorder_mod
from . import WRAPPED, compiled

#: Draws that pick, order or sample from a collection: they decide who gets which item.
SELECTIONS = ("shuffle", "sample", "choice", "choices", "permutation")
_PY_DRAWS = ("shuffle", "sample", "choice", "choices", "random", "randint", "randrange", "uniform",
             "gauss", "normalvariate", "getrandbits")
_NP_DRAWS = ("shuffle", "permutation", "choice", "rand", "randn", "randint", "random", "random_sample",
             "uniform", "normal", "integers")
#: At most this many draws recorded per call site, and in all, in one window.
PER_SITE = 16
TOTAL = 2000
#: Draw calls after which the window closes (a loop, not a set-up).
CALLS = 20000
_ELEMS = 4096

_state: dict = {"open": False, "wrapped": [], "handles": [], "count": 0, "calls": 0, "per_site": {}}
_lock = threading.Lock()


def _rec():
    rec = recorder_mod.get()
    if rec is None or not rec.enabled or getattr(rec.local, "depth", 0):
        return None
    return rec


def _plain(v, depth: int = 0) -> str:
    """Text of a value that is the same on every rank when the value is (numbers, strings, paths,
    tuples of them); other objects by type name only (their repr may hold addresses)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if depth < 2 and isinstance(v, tuple):
        return "(" + ",".join(_plain(x, depth + 1) for x in v[:64]) + ")"
    name = type(v).__name__
    if name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return "P" + str(v)
    if name == "ndarray" or name.startswith(("int", "uint", "float")):
        return _array(v)
    return name


def _array(a) -> str:
    try:
        import numpy as np

        flat = np.ascontiguousarray(np.asarray(a).flat[:_ELEMS])  # never a copy of the whole array
        return f"a{flat.dtype.str}{np.shape(a)}:{zlib.crc32(flat.tobytes()):08x}"
    except Exception:
        return type(a).__name__


def digest(v) -> str:
    """CRC-32 (8 hex digits) of a draw's input or result, from its first 4096 elements."""
    if isinstance(v, (list, tuple, range)):
        text = f"{type(v).__name__}{len(v)}[" + ",".join(_plain(x) for x in v[:_ELEMS]) + "]"
    elif type(v).__name__ == "ndarray":
        text = _array(v)
    else:
        text = _plain(v)
    return format(zlib.crc32(text.encode("utf-8", "backslashreplace")), "08x")


def _seed_value(v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        return "crc:" + digest(v)
    return int(v)


def _emit_seed(gen: str, value) -> None:
    rec = _rec()
    if rec is None:
        return
    try:
        rec.emit({"t": "seed", "gen": gen, "value": _seed_value(value), "ts": rec.now_us(),
                  "site": rec.sites.current(3)})
    except Exception as exc:
        rec.internal_error(exc)


def _draw_wrapper(gen: str, fn: str, orig):
    def draw(*args, **kwargs):
        if not _state["open"]:
            return orig(*args, **kwargs)
        site = _draw_site()
        if site is None:
            return orig(*args, **kwargs)
        try:  # before the call: shuffle works in place
            inp = digest(args[0] if fn in SELECTIONS and args else args + tuple(sorted(kwargs.items())))
        except Exception:
            inp = "?"
        result = orig(*args, **kwargs)
        ty = type(args[0]).__name__ if fn in SELECTIONS and args else None
        _emit_draw(gen, fn, inp, ty, args[0] if fn == "shuffle" and args else result, site)
        return result

    return functools.wraps(orig)(draw)


def _draw_site():
    """The call site of a draw to record, or None (not a rank, or over the caps). Checked before
    any digest is computed; a loop drawing CALLS times is not a set-up: the window closes."""
    _state["calls"] += 1
    if _state["calls"] > CALLS:
        close("draws")
        return None
    rec = _rec()
    if rec is None or _state["count"] >= TOTAL:
        return None
    try:
        site = rec.sites.current(3)
        n = _state["per_site"].get(site, 0)
        if n >= PER_SITE:
            return None
        _state["per_site"][site] = n + 1
        _state["count"] += 1
        return site
    except Exception as exc:
        rec.internal_error(exc)
        return None


def _emit_draw(gen: str, fn: str, inp: str, ty: str | None, result, site: int) -> None:
    rec = _rec()
    if rec is None:
        return
    try:
        out = {"t": "rng", "op": "draw", "gen": gen, "fn": fn, "in": inp, "out": digest(result),
               "ts": rec.now_us(), "site": site}
        if ty is not None:
            out["ty"] = ty
        rec.emit(out)
    except Exception as exc:
        rec.internal_error(exc)


def _wrap_attr(owner, name: str, make) -> None:
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, WRAPPED, False):
        return
    try:
        new = make(orig)
        setattr(new, WRAPPED, True)
        setattr(owner, name, new)
    except (AttributeError, TypeError):
        return
    _state["wrapped"].append((owner, name, orig, new))


def _seed_wrapper(gen: str, orig):
    def seed(*args, **kwargs):
        result = orig(*args, **kwargs)
        value = args[0] if args else kwargs.get("a", kwargs.get("seed"))
        # default_rng(): a fresh generator, no seed to compare; after the window: not recorded
        if gen != "numpy_rng" or (value is not None and _state["open"]):
            _emit_seed(gen, value)
        return result

    return functools.wraps(orig)(seed)


def patch() -> None:
    """Wrap the seeding functions (for good) and the draw functions (until the set-up window
    closes); never raises."""
    with _lock:
        if _state["open"] or _state["wrapped"]:
            return
        _state["open"] = True
    # random.seed / np.random.seed stay wrapped (a rank-dependent seed is reported as info);
    # default_rng, which libraries may call per step, only while the window is open
    _wrap_attr(random, "seed", lambda o: _seed_wrapper("python", o))
    for fn in _PY_DRAWS:
        _wrap_attr(random, fn, lambda o, fn=fn: _draw_wrapper("python", fn, o))
    try:
        import numpy.random as npr
    except Exception:
        npr = None
    if npr is not None:
        _wrap_attr(npr, "seed", lambda o: _seed_wrapper("numpy", o))
        _wrap_attr(npr, "default_rng", lambda o: _seed_wrapper("numpy_rng", o))
        for fn in _NP_DRAWS:
            _wrap_attr(npr, fn, lambda o, fn=fn: _draw_wrapper("numpy", fn, o))
    _install_window_end()


def _install_window_end() -> None:
    try:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        from torch.utils.data import DataLoader
    except Exception:
        close("unsupported")
        return

    def on_forward(module, args):
        close("forward")
        return None

    def on_step(opt, args, kwargs):
        close("step")
        return None

    _state["handles"] = [register_module_forward_pre_hook(on_forward), register_optimizer_step_pre_hook(on_step)]
    compiled.before_compile(lambda: close("compile"))  # (see compiled: the global hook goes first)
    _wrap_attr(DataLoader, "__iter__", lambda o: _iter_wrapper(o))


def _iter_wrapper(orig):
    def __iter__(self):
        if _state["open"]:
            close("iter")
        return orig(self)

    return functools.wraps(orig)(__iter__)


def _state_digests() -> dict:
    out = {}
    try:
        out["py"] = format(zlib.crc32(repr(random.getstate()).encode()), "08x")
    except Exception:
        pass
    try:
        import numpy.random as npr

        st = npr.get_state()
        out["np"] = format(zlib.crc32(st[1].tobytes() + repr(st[2:]).encode()), "08x")
    except Exception:
        pass
    return out


def close(why: str) -> None:
    """End of the set-up window: record it (and the generators' state digests), take the draw
    wrappers and the window hooks out again. Idempotent."""
    with _lock:
        if not _state["open"]:
            return
        _state["open"] = False
        wrapped, _state["wrapped"] = _state["wrapped"], []
        handles, _state["handles"] = _state["handles"], []
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass
    keep = []
    for owner, name, orig, new in wrapped:
        if name == "seed":
            keep.append((owner, name, orig, new))
        elif getattr(owner, name, None) is new:
            setattr(owner, name, orig)  # names bound earlier keep the wrapper: it calls through
    _state["wrapped"] = keep
    rec = _rec()
    if rec is None:
        return
    try:
        rec.emit({"t": "rng", "op": "end", "why": why, "draws": _state["count"], **_state_digests(),
                  "ts": rec.now_us(), "site": rec.sites.current(3)})
    except Exception as exc:
        rec.internal_error(exc)
