"""The wheel ships one top-level package, fedcomp, and its public imports work from a
fresh virtual environment (offline: the dependencies are this environment's)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from experiments.runtime import PROJECT_ROOT


def test_the_wheel_installs_only_fedcomp_and_its_public_imports_work(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(PROJECT_ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("fedcomp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"fedcomp"}
    assert "fedcomp/flower/mod.py" in names and "fedcomp/flower/strategy.py" in names

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # This environment's dependencies, without its editable fedcomp (a path line is
    # not a site directory: the editable finder's own .pth is not processed).
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
        env={"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin"},
    )
    code = (
        "import fedcomp, importlib.util as u\n"
        "from fedcomp.flower import CompressionMod, CompressedStrategy\n"
        "print(fedcomp.__file__)\n"
        "print([m for m in ('clients', 'strategies', 'experiments') if u.find_spec(m)])\n"
    )
    # Without PYTHONPATH: a checkout on it (as when testing a worktree) would be imported.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path, env=clean
    ).stdout.splitlines()
    assert out[0].startswith(site)  # the wheel's copy, not this checkout
    assert out[1] == "[]"
