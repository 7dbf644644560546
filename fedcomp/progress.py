"""Progress of a long run: round x of N, accuracy, uplink bytes so far, elapsed, ETA.

Modes (the ``progress`` setting):

- ``bar``: one status line on stderr, redrawn in place after every round (the cursor
  is left at its start, so the next log line overwrites it) and erased at the end;
- ``log``: a ``progress:`` log line, at most once per ``log_interval`` seconds (60 by
  default), so short runs and CI logs stay as they are;
- ``auto`` (default): ``bar`` when stderr is a terminal, ``log`` otherwise;
- ``off``.

The ETA averages the rounds after the first (the first round also pays for starting
Ray and the clients).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

log = logging.getLogger("fedcomp.progress")

MODES = ("auto", "bar", "log", "off")


def resolve_mode(mode: str, stream: TextIO) -> str:
    """``auto`` becomes ``bar`` on a terminal and ``log`` otherwise."""
    if mode not in MODES:
        raise ValueError(f"invalid setting progress={mode!r}: allowed: {', '.join(MODES)}")
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if callable(isatty) and isatty() else "log"


def clock_text(seconds: float | None) -> str:
    """h:mm:ss or m:ss ("?" when unknown)."""
    if seconds is None:
        return "?"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(done: int, total: int, first_round_end: float, now: float) -> float | None:
    """Remaining time from the mean duration of rounds 2..done (None before round 2)."""
    if done >= total:
        return 0.0
    if done < 2:
        return None
    return (now - first_round_end) / (done - 1) * (total - done)


def human_bytes(num_bytes: int, decimals: int = 1) -> str:
    """Bytes in decimal units for a person (results.json keeps exact integers); the
    progress line shows one decimal, the per-round log line three."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{decimals}f} {unit}"
    return f"{num_bytes} B"


def progress_text(
    done: int,
    total: int,
    accuracy: float | None,
    uplink_bytes: int,
    elapsed: float,
    eta: float | None,
) -> str:
    acc = "n/a" if accuracy is None else f"{accuracy:.4f}"
    return (
        f"round {done}/{total} ({100 * done // total}%) | accuracy {acc} | uplink "
        f"{human_bytes(uplink_bytes)} so far | elapsed {clock_text(elapsed)} | "
        f"ETA {clock_text(eta)}"
    )


class ProgressReporter:
    """Feed it each finished round's record (the results.json round shape)."""

    def __init__(
        self,
        num_rounds: int,
        mode: str = "auto",
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_interval: float = 60.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(mode, self.stream)
        self.num_rounds = num_rounds
        self.clock = clock
        self.log_interval = log_interval
        self.start = clock()
        self.last_log = self.start
        self.first_round_end: float | None = None
        self.uplink = 0
        self.drawn = False

    def update(self, record: Mapping[str, Any]) -> str:
        """Account one round; draw or log if the mode says so; return the text."""
        now = self.clock()
        done = int(record["round"])
        self.uplink += int(record["uplink_wire_bytes"])
        if self.first_round_end is None:
            self.first_round_end = now
        eta = eta_seconds(done, self.num_rounds, self.first_round_end, now)
        text = progress_text(
            done, self.num_rounds, record.get("accuracy"), self.uplink, now - self.start, eta
        )
        if self.mode == "bar":
            self.stream.write("\r\x1b[K" + text + "\r")
            self.stream.flush()
            self.drawn = True
        elif self.mode == "log" and now - self.last_log >= self.log_interval:
            log.info("progress: %s", text)
            self.last_log = now
        return text

    def close(self) -> None:
        """Erase the status line (bar mode)."""
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False
