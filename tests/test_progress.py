"""The progress display: round x of N, accuracy, bytes so far, ETA; quiet when not a TTY."""

from __future__ import annotations

import io
import logging

import pytest

from fedcomp.progress import ProgressReporter, clock_text, eta_seconds, resolve_mode


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(i: int, acc: float | None = 0.5) -> dict:
    return {"round": i, "accuracy": acc, "uplink_wire_bytes": 1_500_000}


def test_eta_uses_rounds_after_the_first() -> None:
    # Round 1 ended at t=30 (Ray start), rounds 2..3 took 10 s each: 7 rounds left.
    assert eta_seconds(3, 10, first_round_end=30.0, now=50.0) == pytest.approx(70.0)
    assert eta_seconds(1, 10, first_round_end=30.0, now=30.0) is None
    assert eta_seconds(10, 10, first_round_end=30.0, now=99.0) == 0.0
    assert clock_text(3725) == "1:02:05" and clock_text(70) == "1:10" and clock_text(None) == "?"


def test_bar_redraws_one_line_in_place_and_erases_it() -> None:
    clock, stream = _Clock(), _Tty()
    bar = ProgressReporter(10, "auto", stream=stream, clock=clock)
    assert bar.mode == "bar"
    for i, t in ((1, 130.0), (2, 140.0), (3, 150.0)):
        clock.now = t
        bar.update(_record(i))
    out = stream.getvalue()
    assert out.count("\r\x1b[K") == 3 and "\n" not in out
    last = out.split("\r\x1b[K")[-1]
    assert last == (
        "round 3/10 (30%) | accuracy 0.5000 | uplink 4.5 MB so far | elapsed 0:50 | ETA 1:10\r"
    )
    bar.close()
    assert stream.getvalue().endswith("\r\x1b[K")


def test_not_a_terminal_logs_at_most_once_per_interval(caplog) -> None:
    clock, stream = _Clock(), io.StringIO()
    rep = ProgressReporter(100, "auto", stream=stream, clock=clock, log_interval=60.0)
    assert rep.mode == "log"
    with caplog.at_level(logging.INFO, logger="fedcomp.progress"):
        for i in range(1, 21):
            clock.now = 100.0 + 10.0 * i  # a round every 10 s
            rep.update(_record(i, None))
        rep.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "fedcomp.progress"]
    assert len(lines) == 3  # at 60, 120 and 180 s
    assert lines[0].startswith("progress: round 6/100 (6%) | accuracy n/a | uplink 9.0 MB")
    assert stream.getvalue() == ""  # nothing drawn


def test_off_is_silent_and_bad_modes_are_named(caplog) -> None:
    clock, stream = _Clock(), _Tty()
    rep = ProgressReporter(2, "off", stream=stream, clock=clock, log_interval=0.0)
    with caplog.at_level(logging.INFO, logger="fedcomp.progress"):
        rep.update(_record(1))
    assert stream.getvalue() == "" and not caplog.records
    with pytest.raises(ValueError, match=r"progress='loud': allowed: auto, bar, log, off"):
        resolve_mode("loud", stream)
