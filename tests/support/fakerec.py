"""A stand-in for the rank's recorder in one process without a process group: what the
rank-side hooks call (``emit``, ``now_us``, ``sites.current``, ``internal_error``), collected."""

from __future__ import annotations


class _Sites:
    def current(self, depth: int) -> int:
        return 7


class FakeRecorder:
    """Records go to ``out``; internal errors to ``errors``, or raised with ``raise_errors``."""

    writer = object()
    enabled = True

    def __init__(self, raise_errors: bool = False) -> None:
        self.out: list[dict] = []
        self.errors: list[BaseException] = []
        self.sites = _Sites()
        self.raise_errors = raise_errors

    def emit(self, record: dict) -> None:
        self.out.append(record)

    def now_us(self) -> int:
        return 1

    def internal_error(self, exc: BaseException) -> None:
        if self.raise_errors:
            raise exc
        self.errors.append(exc)
