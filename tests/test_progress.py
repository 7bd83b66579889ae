"""The progress report: plain log lines when no bar is shown, and none when a bar is."""

from __future__ import annotations

import pytest

from nmt_cli.progress import ProgressReport


def _line(p: ProgressReport) -> str:
    return f"done={p.done} total={p.total} pairs={p.fields.get('pairs')}"


def test_without_a_bar_the_log_has_a_first_line_and_a_last_line_with_the_counts(
        capsys: pytest.CaptureFixture) -> None:
    with ProgressReport("x", None, _line, first_line="starting x", bar=False, pairs=0) as report:
        report.advance(3, total=10, pairs=1)
        report.advance(4, pairs=2)
    assert capsys.readouterr().err.splitlines() == ["starting x", "done=7 total=10 pairs=2"]


def test_lines_come_every_so_many_seconds_and_none_at_the_end_when_asked(
        capsys: pytest.CaptureFixture) -> None:
    with ProgressReport("x", 5, _line, every_seconds=0.0, at_end=False, bar=False) as report:
        report.advance(2)
        report.advance(3)
    assert capsys.readouterr().err.splitlines() == ["done=2 total=5 pairs=None", "done=5 total=5 pairs=None"]


def test_work_that_fails_gets_no_last_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(RuntimeError), ProgressReport("x", None, _line, bar=False) as report:
        report.advance(1)
        raise RuntimeError
    assert capsys.readouterr().err == ""


def test_a_bar_replaces_the_log_lines(capsys: pytest.CaptureFixture) -> None:
    with ProgressReport("x", 4, _line, first_line="starting x", every_seconds=0.0, bar=True) as report:
        report.advance(4)
    err = capsys.readouterr().err
    assert "starting x" not in err and "done=" not in err and report.done == 4
