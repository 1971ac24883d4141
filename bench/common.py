"""Shared helpers of the benchmark suite: the machine, launching jobs, bounded processes, rows."""

from __future__ import annotations

import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
PY = sys.executable


@dataclass
class Row:
    """One figure of the results table."""

    figure: str  # "1".."5"
    what: str
    result: str  # as printed, e.g. "1.02x"
    target: str  # e.g. "<= 1.05x", "" when none
    ok: bool | None  # None: no target, or not measurable
    notes: str = ""
    value: float | None = None  # the number behind ``result``
    data: dict = field(default_factory=dict)  # everything measured, for the JSON

    def to_json(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    from importlib.metadata import version

    try:
        torch_version = version("torch")
    except Exception:
        torch_version = "?"
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cores": os.cpu_count(), "cpu": cpu_model(), "torch": torch_version,
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}",
            "memory_gb": round(mem / 2**30, 1)}


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str | os.PathLike, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(script), *args]


def plain_env() -> dict[str, str]:
    """This environment without any ddpdoctor or torch.distributed debug setting."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DDPDOCTOR_") and k not in ("TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL")}
    boot = str(ROOT / "ddpdoctor" / "rank" / "_bootstrap")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != boot]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + paths)
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets anyway; quiets its warning
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """End a job started with start_new_session=True: torchrun, its agent and every rank."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
                ) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr); the whole process group is ended on
    timeout."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd or str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return None, out, err


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(max - min) / median: how much repetitions of the same thing differ."""
    if len(xs) < 2:
        return 0.0
    m = median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0
