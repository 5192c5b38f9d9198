"""`python -m engine_native.kernels`: build (or find) Sluice's CPU kernels now rather than at first use."""

from __future__ import annotations

import sys

from engine_native.kernels import cpu_kernels

module = cpu_kernels()
print(f"Sluice CPU kernels: {module.__file__ if module is not None else 'unavailable (PyTorch paths only)'}")
sys.exit(0)
