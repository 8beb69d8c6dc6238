"""Progress on a terminal is tqdm's bar; elsewhere plain lines, never a carriage return."""

import io
import sys

from megacommon import progress


def test_plain_lines_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()  # not a TTY
    monkeypatch.setattr(sys, "stderr", err)
    clock = iter([0.0, 10.0, 40.0, 40.0, 41.0, 100.0])  # start, 3 updates, 2 lines
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.progress_bar(4, "lambada", "example")
    assert isinstance(bar, progress.PlainProgress)
    with bar:
        bar.update(1)  # 10 s: too soon for a line
        bar.update(1)  # 40 s: a line, with the ETA at this pace
        bar.update(2)  # 41 s
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue()
    assert lines == [
        "lambada: 2/4 example (50%), elapsed 40 s, ETA 40 s",
        "lambada: 4/4 example (100%), elapsed 1 min 40 s",
    ]


def test_no_progress_draws_nothing(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with progress.progress_bar(3, "x", "it", enabled=False) as bar:
        bar.update(3)
    assert err.getvalue() == ""


def test_durations_read_as_time():
    assert [progress.duration(s) for s in (4.4, 65, 7260)] == ["4 s", "1 min 05 s", "2 h 01 min"]
