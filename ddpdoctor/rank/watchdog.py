"""The in-rank hang watchdog.

A daemon thread per rank looks at what the rank's threads are waiting in (``rec.inflight``).
gloo and NCCL release the GIL while they wait, so the thread runs while the main thread is
blocked in C++. When a call has been pending longer than the hang timeout:

1. the rank claims the report of this episode through the job's own c10d store
   (``compare_set``: exactly one reporter, on any node, no home-made network protocol);
2. every rank's watchdog sees the new episode (a counter in the store) and publishes its
   position: the collective it waits in, or, if none, the Python stack of each of its threads
   and its CPU use; ranks that exited published how (``exit/<rank>``);
3. the reporter gathers the positions (bounded wait), builds the diagnosis (``hangdiag``),
   prints it once, writes it next to the traces and into its trace file;
4. with ``--on-hang kill`` the reporter sets a kill flag; every rank writes the marker file that
   its node's launcher watches and ends itself (exit 124), so CI never hangs.

It never issues a collective on any group, never takes a lock a rank's thread holds while
blocked, and bounds its own waits (store timeout, collection deadline).
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time

from ..errors import EXIT_HANG
from ..trace import records
from ..trace.files import KILL_MARKER, hostname, stacks_path
from ..trace.records import InFlight
from ..verdict import hang as hangdiag
from . import frcapture

#: A pending call is written to the trace once it has waited this long, so that a rank killed
#: later (SIGKILL cannot be caught) still shows where it was.
PENDING_RECORD_AFTER_S = 1.0
_GRACE_S = 1.5


def start(rec) -> Watchdog | None:
    if rec.watchdog is not None or rec.settings.hang_timeout <= 0:
        return rec.watchdog
    wd = Watchdog(rec)
    rec.watchdog = wd
    wd.start()
    return wd


def _stacks() -> list[dict]:
    """Every thread's Python stack (outermost first), without this watchdog's own thread."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    me = threading.get_ident()
    out = []
    for tid, frame in frames.items():
        if tid == me:
            continue
        stack = []
        f = frame
        while f is not None and len(stack) < 40:
            code = f.f_code
            stack.append([code.co_filename, f.f_lineno, code.co_name,
                          linecache.getline(code.co_filename, f.f_lineno).strip()])
            f = f.f_back
        stack.reverse()
        out.append({"thread": names.get(tid, str(tid)), "main": tid == main_id, "frames": stack})
    out.sort(key=lambda t: not t["main"])
    return out


class Watchdog(threading.Thread):
    def __init__(self, rec) -> None:
        super().__init__(name="ddpdoctor-watchdog", daemon=True)
        self.rec = rec
        self.timeout = float(rec.settings.hang_timeout)
        self.interval = max(0.05, min(0.5, self.timeout / 10))
        self._stop_evt = threading.Event()
        self._tick_lock = threading.Lock()
        self._store = None
        self._store_failed = False
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"ddpdoctor/{rec.settings.run_id or 'run'}/{attempt}/"
        self.published_ep = 0
        self.reported: set = set()  # (group, seq, op) hangs already reported by this rank
        self.reporting: dict | None = None  # the episode this rank reports: {"ep", "key", "t"}
        self.pending_written: set = set()
        self._cpu = (time.monotonic(), self._cpu_time())
        self.cpu_percent: float | None = None
        self.local_reported: set = set()

    # -- lifecycle ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop; a hang this rank reported and that has since completed is declared resolved."""
        self._stop_evt.set()
        with self._tick_lock:
            if self.reporting is not None and self._store is not None:
                try:
                    self._check_resolved(self._store, self.rec.now_us())
                except Exception:
                    pass

    def run(self) -> None:
        try:
            self._publish_info()
        except Exception as exc:
            self.rec.internal_error(exc)
        while not self._stop_evt.wait(self.interval):
            try:
                with self._tick_lock:
                    if not self._stop_evt.is_set():
                        self.tick()
            except Exception as exc:  # the watchdog must never take the rank down
                self.rec.internal_error(exc)

    # -- store -------------------------------------------------------------------------------
    def store(self):
        if self._store is None and not self._store_failed:
            try:
                from datetime import timedelta

                from torch.distributed import distributed_c10d as c10d

                base = c10d._get_default_store()
                try:
                    # Our own connection: never interleave with the main thread's store use.
                    st = base.clone()
                except Exception:
                    st = base
                try:
                    st.set_timeout(timedelta(seconds=5))
                except Exception:
                    pass
                self._store = st
            except Exception:
                self._store_failed = True
        return self._store

    def _key(self, k: str) -> str:
        return self.prefix + k

    def _publish_info(self) -> None:
        st = self.store()
        if st is None or self.rec.rank is None:
            return
        path = self.rec.writer.path if self.rec.writer is not None else ""
        st.set(self._key(f"info/{self.rec.rank}"), json.dumps(
            {"pid": os.getpid(), "host": hostname(), "stacks": stacks_path(path) if path else ""}))

    def publish_exit(self, info: dict) -> None:
        """Called from the exit hooks: tell the others how this rank ended."""
        st = self.store()
        if st is None or self.rec.rank is None:
            return
        try:
            st.set(self._key(f"exit/{self.rec.rank}"), json.dumps(info, default=str))
        except Exception:
            pass

    # -- one look ----------------------------------------------------------------------------
    @staticmethod
    def _cpu_time() -> float:
        t = os.times()
        return t.user + t.system

    def tick(self) -> None:
        rec = self.rec
        now_m = time.monotonic()
        cpu = self._cpu_time()
        dt = now_m - self._cpu[0]
        if dt > 0:
            self.cpu_percent = 100.0 * (cpu - self._cpu[1]) / dt
        self._cpu = (now_m, cpu)
        now = rec.now_us()
        oldest = None
        from .staleinflight import drop_stale

        drop_stale(rec)  # a backward that raised leaves its entry behind
        for info in map(InFlight._make, list(rec.inflight.values())):
            waited = (now - info.ts) / 1e6
            if waited >= PENDING_RECORD_AFTER_S:
                key = (info.op, info.g, info.s, info.ts)
                if key not in self.pending_written:
                    self.pending_written.add(key)
                    rec.emit({"t": "pending", "op": info[0], "g": info[1], "s": info[2],
                              "site": info[3], "ts": info[4], "waited_s": round(waited, 3)})
            if oldest is None or info[4] < oldest[4]:
                oldest = info
        if oldest is not None and (now - oldest[4]) / 1e6 >= self.timeout / 2:
            frcapture.warm()  # a possible hang: make the Flight Recorder dump at the hang quick
        st = self.store()
        if st is not None:
            try:
                self._coordinate(st, oldest, now)
                return
            except Exception as exc:
                # The store is gone (its host rank died): fall back to what this rank knows.
                self._store_failed = True
                self._store = None
                if rec.settings.debug:
                    rec.internal_error(exc)
        if oldest is not None and (now - oldest[4]) / 1e6 >= self.timeout:
            self._local_only(oldest, now)

    def _status(self, now: int) -> dict:
        rec = self.rec
        infl = list(rec.inflight.values())
        st: dict = {"rank": rec.rank, "pid": os.getpid(), "host": hostname(), "seq": rec.position(),
                    "cpu": None if self.cpu_percent is None else round(self.cpu_percent, 1),
                    "ddp_steps": _ddp_steps(rec)}
        exit_info = rec.exit_info
        if exit_info and not infl:
            # The main thread raised, yet the process lives on (a non-daemon thread keeps it).
            st.update(state="exited", exit=exit_info, stacks=_stacks())
        elif infl:
            op, g, s, site, start = min(infl, key=lambda i: i[4])
            st.update(state="collective", op=op, g=g, s=s, site=rec.sites.records.get(site),
                      since_s=round((now - start) / 1e6, 3))
            st["stacks"] = [t for t in _stacks() if t["main"]]
            if rec.last_event is not None:  # where it was before: how its path left the others'
                lop, lg, ls, lsite, _end = rec.last_event
                st["last"] = {"op": lop, "g": lg, "s": ls, "site": rec.sites.records.get(lsite)}
        else:
            st.update(state="running", stacks=_stacks())
            if rec.last_event is not None:
                op, g, s, site, end = rec.last_event
                st["last"] = {"op": op, "g": g, "s": s, "site": rec.sites.records.get(site),
                              "ago_s": round((now - end) / 1e6, 3)}
        return st

    def _coordinate(self, st, oldest, now: int) -> None:
        rec = self.rec
        # 1. A new episode announced by someone: publish where this rank is.
        ep = st.add(self._key("epcount"), 0)
        if ep > self.published_ep:
            self.published_ep = ep
            status = self._status(now)
            st.set(self._key(f"status/{ep}/{rec.rank}"), json.dumps(status, default=str))
            if not (self.reporting and self.reporting["ep"] == ep):
                rec.emit({"t": "hang", "role": "member", "ep": ep, "status": status, "ts": now})
            frcapture.dump_async(rec.settings.out, rec.rank)  # PyTorch's own record of its calls
        # 2. The kill flag: end this rank (the launcher ends the rest of the node's tree).
        if st.check([self._key("kill")]):
            self._die()
        # 3. Resolution of the hang this rank reports.
        if self.reporting is not None:
            self._check_resolved(st, now)
            return
        # 4. A local hang: claim the report of a new episode (one reporter for the whole job).
        if oldest is None or (now - oldest[4]) / 1e6 < self.timeout:
            return
        key = (oldest[0], oldest[1], oldest[2], oldest[4])
        if key in self.reported:
            return
        active = st.check([self._key("active")]) and st.get(self._key("active")).decode()
        if active:
            return  # another rank is reporting the ongoing episode
        self.reported.add(key)
        new_ep = st.add(self._key("epcount_claim"), 1)
        got = st.compare_set(self._key("active"), "", str(new_ep)).decode()
        if got != str(new_ep):
            return
        self.reporting = {"ep": new_ep, "key": key}
        self._report(st, new_ep, now)

    def _check_resolved(self, st, now: int) -> None:
        rec = self.rec
        key = self.reporting["key"]
        if any((i.op, i.g, i.s, i.ts) == key for i in map(InFlight._make, list(rec.inflight.values()))):
            kill_at = self.reporting.get("kill_at")
            if kill_at is not None and now >= kill_at:
                print(f"ddpdoctor: HANG: {key[0]} #{key[2]} in process group {key[1]} still has not "
                      f"completed after {(now - key[3]) / 1e6:.0f} s with every rank inside it",
                      file=sys.stderr, flush=True)
                st.set(self._key("kill"), str(self.reporting["ep"]))
                self._die()
            return
        waited = (now - key[3]) / 1e6
        if rec.last_failed == key:
            msg = (f"ddpdoctor: the hung {key[0]} #{key[2]} in process group {key[1]} ended with an "
                   f"error after {waited:.1f} s (the backend's timeout or a peer's failure)")
            print(msg, file=sys.stderr, flush=True)
            rec.emit({"t": "hang", "role": "failed", "ep": self.reporting["ep"],
                      "waited_s": round(waited, 3), "ts": now})
            self._write_file(f"hang-{self.reporting['ep']}.txt", msg + "\n", append=True)
            self.reporting = None
            return
        msg = (f"ddpdoctor: resolved: {key[0]} #{key[2]} in process group {key[1]} completed "
               f"after about {waited:.1f} s (it was diagnosed at {self.timeout:g} s): a slow rank, "
               "not a hang")
        print(msg, file=sys.stderr, flush=True)
        rec.emit({"t": "hang", "role": "resolved", "ep": self.reporting["ep"],
                  "waited_s": round(waited, 3), "ts": now})
        self._write_file(f"hang-{self.reporting['ep']}.txt", msg + "\n", append=True)
        try:
            st.compare_set(self._key("active"), str(self.reporting["ep"]), "")
        except Exception:
            pass
        self.reporting = None

    def _report(self, st, ep: int, now: int) -> None:
        rec = self.rec
        world = rec.world or 1
        status = self._status(now)
        st.set(self._key(f"status/{ep}/{rec.rank}"), json.dumps(status, default=str))
        frcapture.dump_async(rec.settings.out, rec.rank)
        # Announce: bump the episode counter the others watch to the claimed number.
        cur = st.add(self._key("epcount"), 0)
        if cur < ep:
            st.add(self._key("epcount"), ep - cur)
        self.published_ep = max(self.published_ep, ep)
        keys = [self._key(f"status/{ep}/{r}") for r in range(world)]
        deadline = time.monotonic() + max(1.5, 3 * self.interval + 0.5)
        while time.monotonic() < deadline and not st.check(keys):
            time.sleep(0.05)
        statuses: dict[int, dict] = {}
        for r in range(world):
            k = keys[r]
            if st.check([k]):
                try:
                    statuses[r] = json.loads(st.get(k))
                except Exception:
                    pass
            if r not in statuses:
                statuses[r] = self._absent(st, r)
        group = status.get("g", "0")
        members = rec.group_ranks.get(group) if group != "0" else None
        diag = hangdiag.diagnose(statuses, world, self.timeout, rec.rank, members)
        text = hangdiag.render(diag, statuses)
        print("\n" + text + "\n", file=sys.stderr, flush=True)
        rec.emit({"t": "hang", "role": "reporter", "ep": ep, "status": status, "diag": diag, "ts": now,
                  "statuses": {str(r): _slim(s) for r, s in statuses.items()}})
        self._write_file(f"hang-{ep}.txt", text + "\n")
        self._write_file(f"hang-{ep}.json", json.dumps({"diagnosis": diag, "statuses": statuses},
                                                       default=str, indent=1))
        if rec.writer is not None:
            rec.writer.sync()
        if rec.settings.on_hang == "kill":
            if diag["verdict"] == hangdiag.BACKEND:
                # Every rank is inside the same collective: most likely slow (an overloaded
                # machine, a large transfer), not stuck. End the job only if it stays so for
                # another hang timeout.
                self.reporting["kill_at"] = now + int(self.timeout * 1e6)
                return
            st.set(self._key("kill"), str(ep))
            self._die()

    def _absent(self, st, r: int) -> dict:
        """What can be known of a rank that did not publish its position."""
        out: dict = {"rank": r, "state": "unknown", "detail": "did not answer"}
        try:
            if st.check([self._key(f"exit/{r}")]):
                out.update(state="exited", exit=json.loads(st.get(self._key(f"exit/{r}"))))
                return out
            if not st.check([self._key(f"info/{r}")]):
                return out
            info = json.loads(st.get(self._key(f"info/{r}")))
        except Exception:
            return out
        if info.get("host") != hostname():
            out["detail"] = f"no answer from {info.get('host')} pid {info.get('pid')}"
            return out
        import psutil

        try:
            p = psutil.Process(int(info["pid"]))
            status = p.status()
        except psutil.NoSuchProcess:
            out.update(state="exited", exit={"how": "gone (killed?)", "pid": info.get("pid")})
            return out
        except psutil.Error:
            return out
        if status == psutil.STATUS_ZOMBIE:
            out.update(state="exited", exit={"how": "exited (zombie)", "pid": info.get("pid")})
            return out
        # Alive but silent: its watchdog cannot run (the GIL is held in C code). Ask for a
        # C-level stack dump (faulthandler on SIGUSR2) and include the end of it.
        out["detail"] = f"alive ({status}) but silent: GIL held?"
        path = info.get("stacks")
        try:
            import signal

            os.kill(int(info["pid"]), signal.SIGUSR2)
            time.sleep(0.3)
            if path and os.path.exists(path):
                with open(path, errors="replace") as f:
                    out["faulthandler"] = f.read()[-4000:]
        except OSError:
            pass
        return out

    def _local_only(self, oldest, now: int) -> None:
        """No store: report what this rank alone knows, once per hung call."""
        key = (oldest[0], oldest[1], oldest[2], oldest[4])
        if key in self.local_reported:
            return
        self.local_reported.add(key)
        rec = self.rec
        status = self._status(now)
        statuses = {rec.rank: status}
        diag = hangdiag.diagnose(statuses, 1, self.timeout, rec.rank, [rec.rank])
        diag["reason"] = "the other ranks could not be reached (the job's store is gone)"
        text = hangdiag.render(diag, statuses)
        print(f"\n[rank {rec.rank}] " + text + "\n", file=sys.stderr, flush=True)
        rec.emit({"t": "hang", "role": "local", "ep": 0, "status": status, "diag": diag, "ts": now})
        self._write_file(f"hang-local-rank{rec.rank}.txt", text + "\n")
        if rec.settings.on_hang == "kill":
            self._die()

    def _write_file(self, name: str, text: str, append: bool = False) -> None:
        out = self.rec.settings.out
        if not out:
            return
        try:
            from ..trace.outfault import open_private

            with open_private(os.path.join(out, name), append) as f:
                f.write(text)
        except OSError:
            pass

    def _die(self) -> None:
        """--on-hang kill: leave the marker for the launcher, flush, and end this rank."""
        rec = self.rec
        self._write_file(KILL_MARKER, f"{hostname()} {os.getpid()} rank {rec.rank}\n", append=True)
        try:
            rec.emit(records.exit_record("hang-kill", ts=rec.now_us(), inflight=records.inflight_list(rec.inflight)))
            rec.exit_recorded = True
            if rec.writer is not None:
                rec.writer.sync()
        except Exception:
            pass
        self._stop_evt.set()
        # The ranks do not end at the same instant: the last ones would print the collateral
        # "Connection closed by peer" tracebacks of their hung calls, burying the diagnosis.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        except OSError:
            pass
        time.sleep(_GRACE_S)
        os._exit(EXIT_HANG)


def _ddp_steps(rec) -> int:
    """DDP backward passes this rank has run (over all its DDP modules)."""
    n = 0
    for ref in rec.ddp_refs:
        mod = ref()
        info = getattr(mod, "_ddpdoctor", None) if mod is not None else None
        if info:
            n += int(info.get("bwd", 0))
    return n


def _slim(status: dict) -> dict:
    """A status without its full stacks (the reporter's trace record stays small)."""
    s = dict(status)
    if s.get("stacks"):
        s["stacks"] = [dict(t, frames=t["frames"][-12:]) for t in s["stacks"] if t.get("main")]
    return s
