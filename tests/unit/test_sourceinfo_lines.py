"""trace/sourceinfo: a frame without a line number (f_lineno None) has no enclosing branches."""

from __future__ import annotations

from ddpdoctor.trace import sourceinfo


def test_enclosing_with_and_without_a_line(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("for i in range(3):\n    if i:\n        print(i)\n")
    assert sourceinfo.enclosing(str(src), 3) == [[1, "for i in range(3):", "for"], [2, "if i:", "if"]]
    assert sourceinfo.enclosing(str(src), None) == []
    assert sourceinfo.conditions_for_stack([(str(src), None), (str(src), 2)]) == [
        [str(src), 1, "for i in range(3):", "for"]]
