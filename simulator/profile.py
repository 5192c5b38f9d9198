"""A worker's costs, per engine step, as the simulator uses them.

    decode step  = step_base_s + per_seq_s x running + per_context_token_s x (tokens in their contexts)
    prefill      = prefill_base_s + prompt tokens / prefill_tokens_per_s, during which decode pauses

A profile is data (JSON under simulator/profiles/): `cpu-smollm2-135m.json` was measured on this
machine's engine (`sluice bench profile`), `h100-llama70b-tp8.json` is a cost model of a 70B model at
tensor parallelism 8 on H100s, derived in its `notes` from bandwidth and FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class CostProfile:
    name: str
    step_base_s: float
    """Fixed time of a decode step (weights read once per step, launch and sync overheads)."""
    per_seq_s: float
    """Extra time per running sequence in a decode step (its activations, sampling)."""
    per_context_token_s: float
    """Extra time per token of context attended to in a decode step (its KV read)."""
    prefill_tokens_per_s: float
    """Prompt tokens computed per second when prefilling (compute-bound); inf: prefill is free."""
    prefill_base_s: float = 0.0
    """Fixed time of a prefill step."""
    max_num_seqs: int = 64
    """Sequences one worker runs at once."""
    kv_tokens: int = 1 << 20
    """Tokens the worker's KV cache holds (prompt + output of every running sequence)."""
    cold_start_s: float = 120.0
    """From asking for a worker to it serving (schedule, image pull, weights load, warm-up)."""
    source: str = "derived"  # "measured" or "derived"
    notes: list[str] = field(default_factory=list)

    def decode_step_s(self, running: int, context_tokens: int) -> float:
        return self.step_base_s + self.per_seq_s * running + self.per_context_token_s * context_tokens

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_base_s + prompt_tokens / self.prefill_tokens_per_s

    @classmethod
    def load(cls, name_or_path: str) -> CostProfile:
        """A profile by name (simulator/profiles/<name>.json) or by path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILES / f"{name_or_path}.json"
        data = json.loads(path.read_text())
        data.pop("measurements", None)  # the raw table the figures were fitted on
        return cls(**data)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))
