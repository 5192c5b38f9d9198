"""Frozen configuration for the native engine, one dataclass per layer.

Environment variables are never read here: the CLI/driver builds these
objects at the edge and hands them down.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer (Llama family, Qwen2)."""

    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style RoPE scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict[str, float | str] | None = None
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v projections
    tie_word_embeddings: bool = False
    name: str = "model"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: one pool of fixed-size blocks allocated once at start."""

    block_size: int = 16  # tokens per block
    # Exactly one of these sizes the pool; num_blocks wins when both are set.
    num_blocks: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float = 0.25  # of the host memory available at start, when neither is set
    enable_prefix_caching: bool = True  # reuse full KV blocks of identical prefixes
    share_prefix_across_tenants: bool = False  # when False, a tenant id salts every block hash
    # On CUDA, without an explicit size: this fraction of the device memory still free once the
    # weights are loaded (torch.cuda.mem_get_info) becomes the pool; the rest is activations' headroom.
    device_memory_fraction: float = 0.9
    # Preemption (swap.py): "recompute" frees a victim's blocks and recomputes it later; "swap" copies
    # its KV blocks to a host pool and back when the pool has room; "auto" swaps only when the cost
    # estimate says copying is cheaper than recomputing. Without a host pool every mode recomputes.
    preemption_mode: str = "auto"
    # The host pool preempted requests' KV is swapped to (pinned memory on CUDA). swap_num_blocks wins
    # when set; None for both: 4 GiB on CUDA, none on CPU (the KV already lives in host memory there).
    swap_num_blocks: int | None = None
    swap_space_bytes: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """The throughput/latency knobs of continuous batching."""

    max_num_seqs: int = 64  # cap on running sequences per step
    # Token budget of one step (decodes + prefill chunks). 2,048 as vLLM's CPU default: a wave of
    # prompts is prefilled in one or two steps, so a decoding stream meets a prefill step once or
    # twice in its life instead of every few tokens (inter-token p99 2-3x lower at 8 and 32 streams),
    # at the cost of a longer first token for short prompts (docs/engine.md, "Knobs").
    max_num_batched_tokens: int = 2048
    # A single prompt never takes more than this per step. 1,024 rather than 256: a ~970-token prompt is
    # one step's chunk, not four steps' (mixed ~512-token prompts at 32 streams: first tokens ~20% sooner),
    # and the stall this could add to decoders is `prefill_tokens_beside_decodes`' to bound.
    long_prefill_token_threshold: int = 1024
    # A step in which at most one running request decodes, with requests waiting, may take this many times
    # the budget: a burst of prompts reaching an idle or nearly idle engine is then prefilled in one step
    # instead of two or three, its streams decode and finish in step, and the next burst is not computed
    # beside a decoding group (each such step stalls every stream of that group). The stall of the bigger
    # step falls on one stream at most, but the burst's first tokens wait for the whole of it: measured,
    # 2 halved the server's inter-token p99 at 32 streams and delayed first tokens 15-75% (docs/engine.md,
    # "Knobs"). 1: off.
    wave_budget_factor: int = 1
    # Prompt tokens a step computes beside running decodes (None: the step budget is the only cap).
    # Every decoding stream waits for the whole step, so the prompt work in a step with decodes is the
    # stall of each of their inter-token gaps; a step without decodes takes the full budget, and so does
    # one where no more than twice as many streams decode as prompts wait (the rest of a wave of prompts:
    # cut, it becomes one more group of streams, replaced later beside the others' decodes; see
    # Scheduler._prefill_allowance). A backlog of prompt tokens larger than the cap times
    # `prefill_backlog_steps` lifts it to a share of the backlog (up to the budget), so prompts arriving
    # faster than the cap can serve are not starved. 1,024, half the budget: on mixed prompts at 32
    # streams the inter-token p99 fell ~35% with the threshold above at 1,024 (docs/engine.md, "Knobs").
    prefill_tokens_beside_decodes: int | None = 1024
    prefill_backlog_steps: int = 16
    # Where a waiting request stands among its tenant's (same priority): its arrival time plus this many
    # milliseconds per prompt token, so the requests of one burst go shortest prompt first and a prompt is
    # overtaken only by shorter ones that arrived less than (its length - theirs) x this after it. A burst's
    # short prompts then have their first tokens without waiting out the long ones' prefill; the long ones wait
    # longer, and the burst's last first token comes when it would have (the burst takes as long). None: about
    # a prompt token's prefill, so that the window a prompt can be overtaken in is about its own prefill time:
    # 1 ms on CPU (a 2-core CPU's), 0.1 on CUDA (`default_prompt_order_ms_per_token`). On mixed ~512-token
    # prompts at 32 streams on a 2-core CPU the mean time to first token fell 8-22% over six seeds at the same
    # throughput, the p50 moved either way (docs/engine.md, "Shortest prompt first within a burst"). 0: arrival
    # order.
    prompt_order_ms_per_token: float | None = None
    # How long an idle engine holds its first step for the rest of a burst: requests the driver was still
    # tokenizing when it sent the first ones (`AddRequest.more_coming`; process.py). Held, a burst is prefilled
    # in one step; not held, the requests tokenized first have their first token, and the next step, which
    # prefills the rest, is their first inter-token gap (8 simultaneous ~1,100-token prompts came back from the
    # gateway's 6 tokenizing threads as 6, then 2 a few ms later: six 157-210 ms gaps a burst; docs/engine.md,
    # "The Zen 4 EPYC a third time"). It ends when a request arrives with none left to come (with several engines
    # the rest may go to another: then it runs out). Nothing decodes while it holds; 0: off.
    burst_hold_s: float = 0.025
    max_waiting: int = 256  # bound of the waiting queue; add_request beyond it is refused
    # Second bound of the waiting queue, in tokens (prompts, plus outputs of preempted requests), so
    # a burst of long prompts cannot grow memory without bound either. A request is refused when the
    # queue is not empty and it would take the queue past this; None: no token bound.
    max_waiting_tokens: int | None = 1 << 18
    # Fair-share weights of tenants within one priority (default 1.0): a tenant of weight 2 gets
    # twice the tokens of a tenant of weight 1 when both have work waiting.
    tenant_weights: dict[str, float] = field(default_factory=dict)


def default_prompt_order_ms_per_token(device_type: str) -> float:
    """`SchedulerConfig.prompt_order_ms_per_token` left unset: about a prompt token's prefill time there."""
    return 0.1 if device_type == "cuda" else 1.0


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine's model is split across processes (engine_native/parallel/, docs/parallelism.md).

    Rank 0 is the engine process itself (scheduler, sampling); ranks 1..N-1 are worker processes it
    starts, each holding 1/tp of its stage's layers' heads and MLP columns. The defaults (1, 1) are the
    single-process engine, untouched.
    """

    tensor_parallel_size: int = 1
    # Pipeline stages (layers split in contiguous ranges), each a tensor-parallel group of the size above.
    pipeline_parallel_size: int = 1
    # Micro-batches a step is cut into for the pipeline (whole sequences each); 0: one per stage, so every
    # stage has work once the pipeline fills. 1: none (a stage idles while the others compute).
    micro_batches: int = 0
    # Where rank 0 listens for the group's rendezvous (torch.distributed TCP store). Port 0: a free port
    # picked at start (one host); several hosts need a fixed address and port reachable from all of them.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"  # "gloo" on CPU; "nccl" once the model runs on GPUs
    # A collective that waits longer than this fails the step (a hung rank); a rank that dies fails it at once.
    timeout_s: float = 60.0
    # Command prefix each worker rank is started under, e.g. ["ip", "netns", "exec", "ns1"] (one entry per
    # worker rank, or one for all); empty: started directly.
    worker_launch_prefix: tuple[tuple[str, ...], ...] = ()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


PREFILL_ATTENTION_DTYPES = ("float32", "float32-sdpa", "kv")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs to start."""

    model_path: str
    # Weight/activation dtype: "float32", "bfloat16", or "auto" (bf16 only where the CPU computes it
    # natively; see precision.py).
    dtype: str = "auto"
    # The KV cache's dtype, "float32" or "bfloat16"; None: the model's, but bf16 where dtype is "auto" and the
    # model computes in fp32 on a CPU with Sluice's kernels (engine.default_kv_dtype).
    kv_dtype: str | None = None
    num_threads: int | None = None  # torch intra-op threads; None = all cores
    max_model_len: int | None = None  # defaults to the model's context length
    served_model_name: str | None = None
    seed: int = 0
    # Steps of at most this many tokens multiply by the GGUF Q4_1 / Q8_0 blocks of the weights
    # (model/quant.py: the same weight values, 4-8x fewer bytes read than fp32) instead of the dense
    # weights; bigger steps are compute-bound and use the dense GEMM. 0 turns it off. None: 8, or 2 where the
    # bf16 panels below take the pure-decode steps above it (AVX-512 BF16, no AMX), which from 3 sequences
    # are faster than the blocks' fp32 products (model/llama.py QUANTIZED_MAX_ROWS_BESIDE_BF16_PANELS).
    quantized_max_rows: int | None = None
    # Steps of at most this many tokens (among those) round each token's activations to int8 blocks of 32, one
    # scale a block, and multiply them by the 4- and 8-bit blocks in integer multiply-adds
    # (kernels/quant_int8.cpp), as llama.cpp does on CPUs: the single stream's decode ~1.6x faster on an
    # AVX2-only CPU, at 8-bit activations' accuracy. Not the dense path's products: a request's greedy tokens may
    # differ from its fp32 ones, and with more sequences beside it (a bigger step computes in fp32). From 4
    # rows on the fp32 blocks are as fast. 0 (the default): never.
    int8_activation_max_rows: int = 0
    # Steps of at most this many tokens (among the blocks', above int8_activation_max_rows) round each token's
    # activations to int16 blocks of 32, one scale a block (kernels/quant_rounded.cpp): 65,535 steps of the
    # block's largest magnitude, finer than bf16 for every value within 1/128 of it, and products nearly as fast
    # as int8's where the blocks decode on 8 lanes. Not the fp32 products' bits: a request's greedy tokens agree
    # with Hugging Face fp32 as the fp32 path's do (tests/engine/test_quant_rounded.py, test_numerics.py). None:
    # INT16_ACTIVATION_MAX_ROWS
    # (model/quant.py) on CPUs without AVX-512, 0 (never) on those with it.
    int16_activation_max_rows: int | None = None
    # Pure-decode steps of more sequences, up to this many, multiply by the Q4_1 blocks through AMX where
    # the CPU has AMX-BF16 (kernels/amx_linear.cpp): the dense path's very bf16 weights, dequantized from
    # 0.625 bytes a weight instead of read at 2. Bigger steps are compute-bound: oneDNN is as fast. Prompts
    # stay on oneDNN. 0 turns it off.
    amx_max_rows: int = 64
    # Steps of more than quantized_max_rows tokens, up to this many, multiply by the blocks through the panel
    # kernels (kernels/quant_panel.cpp) where the dense weights are fp32 (no native bf16; AVX-512 or AVX2):
    # the dense path's very fp32 weights, dequantized once per step into an L2-sized panel, from 0.625
    # bytes a weight instead of read at 4; 32-sequence decode steps ~1.5x faster there. Bigger steps are
    # compute-bound: the dense GEMM is as fast. 0 turns it off.
    panel_max_rows: int = 256
    # Pure-decode steps of more than quantized_max_rows sequences, up to this many, multiply by the dense bf16
    # weights laid out once in panels for AVX-512 BF16 dot products (kernels/bf16_panel.cpp) where the CPU has
    # AVX-512 BF16 and no AMX: the same weights and inputs as oneDNN, only the order of the additions
    # differs; 32-sequence decode GEMMs ~1.3x faster than oneDNN's there. Costs a second copy of the dense
    # weights (needs pack_weights; skipped where it would take over a quarter of the available memory).
    # Prompts stay on oneDNN. 0 turns it off.
    bf16_panel_max_rows: int = 256
    # Keep the dense weights in oneDNN's blocked layout (model/llama.py pack_dense): bf16 ones where the CPU
    # computes bf16 natively (the same results, without re-laying a weight out at every GEMM), fp32 ones
    # anywhere (oneDNN's GEMM in place of MKL's: the same products, summed in another order).
    pack_weights: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    node_id: str = "node-0"
    # Where weights, the KV pool and step tensors live: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when
    # torch sees one). On CUDA "auto" dtype means bf16 and the quantized CPU blocks are off (device.py).
    device: str = "auto"
    # Attention over the paged cache (model/attention_backends.py): "auto" is the native CPU path on CPU,
    # FlashInfer on CUDA when importable, else "sdpa" (torch SDPA over gathered blocks, which runs anywhere).
    attention_backend: str = "auto"
    # What the native path's prefill attention computes in: "float32" (as the decode kernel computes, so a
    # request recomputed after preemption or failover keeps its greedy tokens): with a bf16 cache through
    # Sluice's kernel (kernels/prefill_attention.cpp): on a CPU with AMX as split-bf16 tile products (q and the
    # probabilities as three bf16 parts each, exact products summed in fp32; 2-3x faster than SDPA), on other
    # AVX-512 CPUs with fp32 FMAs (1.5-2.5x faster); on AVX2-only CPUs PyTorch's fp32 SDPA; "float32-sdpa",
    # PyTorch's fp32 SDPA everywhere; or "kv", the KV cache's dtype: with a bf16 cache ~2x faster than SDPA
    # in fp32 where the CPU has AMX, q and the softmax probabilities rounded to bf16 (a recomputed request's
    # greedy tokens may then differ).
    prefill_attention_dtype: str = "float32"  # one of PREFILL_ATTENTION_DTYPES
    # CUDA only (cuda_graphs.py): pure-decode steps replay CUDA graphs captured for these batch sizes,
    # padded up to the next one; empty: no graphs. Contexts beyond cuda_graph_max_context run eagerly.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    cuda_graph_max_context: int = 2048
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Append a JSON line per step to this file (step_trace.py: what each step held and how long it took,
    # for finding where inter-token time goes); None: no trace.
    step_trace_path: str | None = None
