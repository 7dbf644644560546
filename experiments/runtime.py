"""Process hygiene for Flower and Ray: telemetry off, a project-local FLWR_HOME, a Ray temp dir."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

#: Ray puts unix sockets under its temp dir; their paths must stay under ~107 bytes.
_MAX_RAY_DIR_LEN = 48


def ray_temp_dir() -> str:
    """A Ray temp dir inside the project, or under /tmp when that path is too long."""
    local = PROJECT_ROOT / ".ray"
    if len(str(local)) <= _MAX_RAY_DIR_LEN:
        local.mkdir(exist_ok=True)
        return str(local)
    path = Path(tempfile.gettempdir()) / f"fedcomp-ray-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return str(path)


def prepare_environment() -> None:
    """Set Flower/Ray environment defaults (only where the user has not set them)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_HOME", str(PROJECT_ROOT / ".flwr"))
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_TMPDIR", ray_temp_dir())
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    Path(os.environ["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)


def quiet_flower(verbose: bool) -> None:
    """One copy of each flwr log line (Hydra owns the root handler), INFO only if verbose."""
    import flwr.supercore.logger  # noqa: F401  (flwr adds its console handler on import)

    flwr_logger = logging.getLogger("flwr")
    for handler in list(flwr_logger.handlers):
        flwr_logger.removeHandler(handler)
    flwr_logger.propagate = True
    flwr_logger.setLevel(logging.INFO if verbose else logging.WARNING)
    flwr_logger.addFilter(_drop_run_simulation_notice)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _drop_run_simulation_notice(record: logging.LogRecord) -> bool:
    """We call run_simulation on purpose: drop its deprecation notice."""
    return "`run_simulation` function is deprecated" not in record.getMessage()


def emit(text: str, out: Path | None) -> None:
    """Print a benchmark's summary and, with ``--out``, write it there too."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
