"""What a run's floating-point trajectory depends on besides its code and seed.

Exact codecs give the same run on any machine; a sparse, stochastically rounded one
(error-feedback top-k, sparseq) amplifies the last bits of the CPU's matrix kernels, so
the same commit and seed can learn differently on another CPU or kernel set
(docs/results.md, "The leaderboard"). results.json records them under ``machine``.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import torch

#: The environment variables that pick torch's and MKL's CPU kernels.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record() -> dict[str, str]:
    """The machine of the process that writes results.json (the server's)."""
    return {
        "cpu": cpu_model(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        **{k.lower(): os.environ[k] for k in KERNEL_VARIABLES if k in os.environ},
    }
