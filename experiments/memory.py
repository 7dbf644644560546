"""Memory measurement and limits for the fuzz tests, the hostile-client tests and the
reliability benchmark (Linux: /proc and setrlimit).

- :func:`address_space_cap` lowers this process's address-space limit for a block of
  code, so an oversized allocation fails there (torch raises RuntimeError, numpy
  MemoryError) instead of taking the machine's memory.
- :func:`reset_peak_rss` and :func:`peak_rss` measure the peak resident memory of a block
  of code (the kernel's high-water mark, which counts torch's allocations as well as
  numpy's and Python's; tracemalloc sees only the latter two).
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
from collections.abc import Iterator
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def virtual_size() -> int:
    """Bytes of address space this process has mapped now (VmSize)."""
    return _status_kib("VmSize") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (False when not allowed)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss() -> int:
    """Peak resident bytes since the last :func:`reset_peak_rss` (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def exact_peaks() -> bool:
    """Make glibc return every large block to the kernel when it is freed (a fixed
    mmap threshold of 64 KiB), so that each measured peak RSS shows a block's own
    allocations instead of reusing memory an earlier block freed. False off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024))


@contextlib.contextmanager
def address_space_cap(headroom: int) -> Iterator[int]:
    """Allow at most ``headroom`` bytes of new address space inside the block.

    Yields the limit in bytes. Only the soft limit changes, and it is restored on exit
    (raising a soft limit back up to the hard limit needs no privilege).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = virtual_size() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
