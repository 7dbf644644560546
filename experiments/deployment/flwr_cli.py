"""The flwr CLI side of a deployment: the staged app and its run config, the
connection in ``$FLWR_HOME/config.toml``, and the ``flwr`` commands (run, ls, log).

Why the app is staged: the SuperLink accepts run-config overrides only for keys that
the app's ``[tool.flwr.app.config]`` already declares (flwr 1.42, ``check_keys``), and
codec or strategy parameters (``codec.bits``) are not among the defaults. So the
launcher copies the FAB's files into the run directory with a ``pyproject.toml``
whose run config IS this run's flattened settings, and runs that app unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from experiments.deployment.processes import DeploymentError, _binary
from experiments.runtime import PROJECT_ROOT
from fedcomp.settings import Settings, flatten, settings_to_dict

BEGIN_MARK = "# BEGIN GENERATED RUN CONFIG"


END_MARK = "# END GENERATED RUN CONFIG"


#: Seconds a flwr CLI call (run, ls, supernode register) may take.
CLI_TIMEOUT = 120.0


def run_config_toml(settings: Settings) -> str:
    """The ``[tool.flwr.app.config]`` body holding exactly these settings."""
    return tomli_w.dumps(flatten(settings_to_dict(settings))).rstrip()


def stage_app(settings: Settings, dest: Path, root: Path = PROJECT_ROOT) -> Path:
    """Copy the FAB's files (``fab-include``) to ``dest`` with this run's run config.

    Returns ``dest``; ``flwr run dest`` then needs no overrides (see the module doc).
    """
    text = (root / "pyproject.toml").read_text()
    if BEGIN_MARK not in text or END_MARK not in text:
        raise DeploymentError("app", f"{root / 'pyproject.toml'} lacks the {BEGIN_MARK} block")
    head, rest = text.split(BEGIN_MARK, 1)
    _, end = rest.split(END_MARK, 1)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    include = tomllib.loads(text)["tool"]["flwr"]["app"]["fab-include"]
    for pattern in include:
        for src in sorted(root.glob(pattern)):
            rel = src.relative_to(root)
            if src.is_file() and rel.name != "pyproject.toml" and "__pycache__" not in rel.parts:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    body = f"{BEGIN_MARK}\n{run_config_toml(settings)}\n{END_MARK}"
    (dest / "pyproject.toml").write_text(head + body + end)
    return dest


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_connection(flwr_home: Path, name: str, entry: dict[str, Any]) -> Path:
    """Add (or replace) ``[superlink.<name>]`` in ``$FLWR_HOME/config.toml``."""
    path = flwr_home / "config.toml"
    with _locked(path):
        data = tomllib.loads(path.read_text()) if path.exists() else {}
        data.setdefault("superlink", {})[name] = entry
        path.write_text(tomli_w.dumps(data))
    return path


def remove_connection(flwr_home: Path, name: str) -> None:
    """Drop ``[superlink.<name>]`` again (the SuperLink behind it is gone)."""
    path = flwr_home / "config.toml"
    with _locked(path):
        if not path.exists():
            return
        data = tomllib.loads(path.read_text())
        if data.get("superlink", {}).pop(name, None) is not None:
            path.write_text(tomli_w.dumps(data))


@dataclass
class FlwrCli:
    """``flwr`` subcommands against one named connection, JSON output parsed."""

    connection: str
    env: dict[str, str]
    cwd: Path
    log_path: Path

    def call(self, args: list[str], *, what: str, timeout: float = CLI_TIMEOUT) -> dict:
        argv = [_binary("flwr"), *args]
        try:
            out = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=self.env,
                cwd=self.cwd,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise DeploymentError("flwr CLI", f"`{what}` took over {timeout:.0f} s") from exc
        with open(self.log_path, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{out.stdout}{out.stderr}\n")
        try:
            reply = json.loads(out.stdout)
        except json.JSONDecodeError:
            reply = {"success": False, "error-message": (out.stdout + out.stderr).strip()}
        if out.returncode != 0 or not reply.get("success", False):
            message = reply.get("error-message") or (out.stdout + out.stderr).strip()
            raise DeploymentError("flwr CLI", f"`{what}` failed: {message}")
        return reply

    def start_run(self, app_dir: Path) -> tuple[int, str]:
        """Start the run; return its id and the directory its FAB unpacks to
        (``$FLWR_HOME/apps/<publisher>.<name>.<version>.<hash>``)."""
        reply = self.call(
            ["run", str(app_dir), self.connection, "--format", "json"], what="flwr run"
        )
        fab = f"{reply['fab-id'].replace('/', '.')}.{reply['fab-version']}.{reply['fab-hash']}"
        return int(reply["run-id"]), fab

    def run_status(self, run_id: int) -> tuple[str, str]:
        reply = self.call(
            ["ls", self.connection, "--run-id", str(run_id), "--format", "json"], what="flwr ls"
        )
        run = reply["runs"][0]
        return str(run["status"]), str(run.get("status-details", ""))

    def register_node(self, public_key: str) -> None:
        self.call(
            ["supernode", "register", public_key, self.connection, "--format", "json"],
            what=f"flwr supernode register {public_key}",
        )

    def stream_logs(self, run_id: int, path: Path) -> subprocess.Popen:
        with open(path, "ab") as out:
            return subprocess.Popen(
                [_binary("flwr"), "log", str(run_id), self.connection, "--stream"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
