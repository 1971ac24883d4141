"""Warnings raised inside wrapped library functions name the same line traced as plain
(rank/warnsite.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from support.jobs import ROOT, assert_no_internal_error, run_bounded, torchrun, trace

PROGRAM = ROOT / "tests" / "e2e" / "programs" / "warning_sites.py"


def _warning_lines(stderr: str) -> list[str]:
    return sorted(line for line in stderr.splitlines() if "UserWarning:" in line)


def test_library_warnings_name_the_same_location_traced_as_plain(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        plain_f = pool.submit(run_bounded, torchrun(PROGRAM), timeout=180)
        res = trace(torchrun(PROGRAM), tmp_path / "trace", "--hang-timeout", "60", "--no-report", timeout=180)
        plain = plain_f.result()
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert_no_internal_error(res)
    expected = _warning_lines(plain.stderr)
    assert expected and all("dataloader.py" in line for line in expected), plain.stderr[-3000:]
    assert _warning_lines(res.stderr) == expected
    assert "ddpdoctor" not in "".join(_warning_lines(res.stderr))
