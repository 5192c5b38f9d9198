"""What the service asks of its engine, whichever driver runs it.

The edge (CLI flags and environment, read once into `gateway.settings.Settings.engine`) fills an
`EngineOptions`; the driver named by `--driver` turns it into its own configuration
(`NativeDriver.from_options` -> `NativeDriverConfig`, `SyntheticDriver.from_options`). A field left
at None means "the driver's own default", so every default lives in one place: the native engine's
in `engine_native/config.py` (and `NativeDriverConfig`), the synthetic driver's in its constructor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from drivers.fleet.config import FleetConfig
from drivers.sglang.config import SGLangConfig
from drivers.supervisor import RestartPolicy
from observability.node_health import NodeHealthConfig


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = None
    """Model path of the native driver; None: the bundled model (SLUICE_MODEL, --model)."""
    served_model_name: str | None = None
    """Model id clients send; None: the driver's (--served-model-name)."""
    dtype: str | None = None
    """Weight/activation dtype, "bfloat16" or "float32" (--dtype)."""
    device: str | None = None
    """Where the native engine computes: "cpu", "cuda" or "auto" (--device)."""
    attention_backend: str | None = None
    """Paged attention of the native engine: "auto", "native", "sdpa", "flashinfer" (--attention-backend)."""
    prefill_attention_dtype: str | None = None
    """What the native CPU path's prefill attention computes in: "float32" or "kv", the KV cache's
    dtype (--prefill-attention-dtype)."""
    bf16_panel_max_rows: int | None = None
    """Pure-decode steps of up to this many sequences through the native engine's bf16 panel kernel where the
    CPU has AVX-512 BF16 and no AMX; 0: oneDNN only (--bf16-panel-max-rows)."""
    int8_activation_max_rows: int | None = None
    """The native engine's steps of at most this many tokens round their activations to int8 blocks of 32 and
    multiply them by the quantized weights in integer multiply-adds, as llama.cpp does; 0: never, fp32
    (--int8-activation-max-rows)."""
    int16_activation_max_rows: int | None = None
    """The native engine's steps of at most this many tokens round their activations to int16 blocks of 32; 0:
    never; None: the engine's default, by CPU (--int16-activation-max-rows)."""
    kv_dtype: str | None = None
    """The native engine's KV cache dtype, "bfloat16" or "float32"; None: the engine's default (--kv-dtype)."""
    num_threads: int | None = None
    """Torch CPU threads per engine; None: torch's choice (--num-threads)."""
    max_model_len: int | None = None
    """Context length cap; None: the model's (--max-model-len)."""
    max_num_seqs: int | None = None
    """Cap on sequences running in one engine step (--max-num-seqs)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step (--max-num-batched-tokens)."""
    long_prefill_token_threshold: int | None = None
    """Largest prefill chunk of one request per step (--long-prefill-token-threshold)."""
    wave_budget_factor: int | None = None
    """Times the step budget a step may take while at most one request decodes and requests wait; 1: off
    (--wave-budget-factor)."""
    prefill_tokens_beside_decodes: int | None = None
    """Prompt tokens a step computes while streams decode; 0: no cap (--prefill-tokens-beside-decodes)."""
    prompt_order_ms_per_token: float | None = None
    """Waiting requests stand in line by arrival plus this many ms per prompt token; 0: arrival order
    (--prompt-order-ms-per-token)."""
    burst_hold_ms: float | None = None
    """How long an idle engine holds its first step for the rest of a burst still being tokenized; 0: off
    (--burst-hold-ms)."""
    max_waiting: int | None = None
    """Requests an engine queues beyond those running before it refuses with 503
    (SLUICE_MAX_WAITING, --max-waiting)."""
    max_waiting_tokens: int | None = None
    """Prompt tokens an engine queues before it refuses with 503; 0: no token bound
    (SLUICE_MAX_WAITING_TOKENS, --max-waiting-tokens)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache pool of one engine; None: a fraction of free memory (--kv-cache-memory)."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV of shared prefixes (--no-prefix-caching turns it off)."""
    step_trace_dir: str | None = None
    """Every native engine appends a JSON line per step to `<dir>/<node id>.jsonl`
    (engine_native/step_trace.py; read with `sluice bench steps`); None: no trace (--step-trace)."""
    model_memory_budget_bytes: int | None = None
    """Memory all model versions hosted by this server may take together, weights and KV pools
    (estimated from the models' headers); a deploy beyond it is refused. None: the host's physical
    memory (SLUICE_MODEL_MEMORY_BUDGET, --model-memory-budget; docs/versions.md)."""
    num_engines: int | None = None
    """Engine processes of the native driver, nodes node-0..N-1 (--engines)."""
    tensor_parallel_size: int | None = None
    """Processes each engine's model is split across (--tensor-parallel-size; docs/parallelism.md)."""
    node_health: NodeHealthConfig | None = None
    """Sluggish / stalled node detection (the --node-* flags)."""
    restart: RestartPolicy | None = None
    """Restarting dead engines, and when to give up (SLUICE_ENGINE_*, the --engine-* flags)."""
    fault_step_delay: Mapping[str, float] = field(default_factory=dict)
    """Chaos testing: extra sleep after every engine step, by node (--fault-step-delay NODE=SECONDS)."""
    synthetic_tokens_per_second: float | None = None
    """Synthetic driver: decode rate per request; 0: unthrottled (--synthetic-tokens-per-second)."""
    synthetic_ttft_s: float | None = None
    """Synthetic driver: time to first token (--synthetic-ttft-ms / 1000)."""
    synthetic_start_delay_s: float | None = None
    """Synthetic driver: how long `start()` takes before it is ready, like loading a model: a worker's
    cold start, for scale from zero (--synthetic-start-delay)."""
    fleet: FleetConfig | None = None
    """Fleet driver: where the workers are and how requests are routed among them (--workers,
    --fleet-* flags, SLUICE_FLEET_*; docs/fleet.md)."""
    sglang: SGLangConfig | None = None
    """SGLang driver: the SGLang servers and how requests are routed among them (--sglang-* flags,
    SLUICE_SGLANG_*; docs/sglang.md)."""


def overrides(**values: Any) -> dict[str, Any]:
    """The options that are set (not None), as keyword arguments for `dataclasses.replace`."""
    return {name: value for name, value in values.items() if value is not None}
