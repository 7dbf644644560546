"""Ray processes of this test session, for the modules that start Ray.

Each such module checks that the Ray processes it started are gone after it stopped
them, and only those: processes that were already alive when it began (another module's
agents still exiting, in a shuffled order) are not its own and are left out."""

from __future__ import annotations

import os
import subprocess
import time

#: Command-line fragments of Ray's own processes (GCS, raylet, workers, the per-node
#: agents, which run as ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``).
RAY_TAGS = ("raylet", "gcs_server", "ray::", "default_worker.py")


def ray_processes() -> dict[int, str]:
    """Ray processes this test session started, pid -> command line: descendants of
    this process, or any process naming this session's Ray temp dir (other runs on the
    machine do not count)."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    )
    rows = [line.split(None, 2) for line in out.stdout.splitlines() if line.strip()]
    rows = [r for r in rows if len(r) == 3]
    parent = {int(r[0]): int(r[1]) for r in rows}

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 1)
            if pid == os.getpid():
                return True
        return False

    ray_dir = os.environ.get("RAY_TMPDIR", "\0")
    return {
        int(r[0]): r[2]
        for r in rows
        if any(tag in r[2] for tag in RAY_TAGS) and (ours(int(r[0])) or ray_dir in r[2])
    }


def new_ray_processes(before: set[int]) -> list[str]:
    """Command lines of this session's Ray processes that are not in ``before``."""
    return [args for pid, args in ray_processes().items() if pid not in before]


def await_no_new_ray_processes(before: set[int], timeout_s: float = 120.0) -> list[str]:
    """Wait until every Ray process started since ``before`` was taken has exited, at
    most ``timeout_s`` (Ray's processes exit on their own after shutdown; a leaked
    raylet or worker lives on indefinitely); the ones still alive then."""
    deadline = time.monotonic() + timeout_s
    while (left := new_ray_processes(before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
