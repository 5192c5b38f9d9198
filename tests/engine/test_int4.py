"""4-bit packed weight copies: made only when lossless, and the model's answers stay the same."""

from __future__ import annotations

import torch

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine
from engine_native.model.bundled import bundled_model_path
from engine_native.model.int4 import int4_kernel_available, int4_linear, pack_int4_lossless
from engine_native.sampling_params import SamplingParams


def test_the_pinned_torch_has_the_int4_cpu_kernel() -> None:
    assert int4_kernel_available()


def q4_1_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight on a Q4_1 grid: groups of 32 equal to scale * q + min, q in 0..15 (both ends used)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    # Real weights centre on zero, so min is about -8 steps (and the kernel's offset, min + 8 steps, is small).
    low = -(7 + 2 * torch.rand(n, k // 32, 1, generator=g)) * scale
    return (q * scale + low).view(n, k)


def test_a_q4_1_grid_repacks_and_multiplies_like_the_dense_weight() -> None:
    w = q4_1_like(96, 256)
    packed = pack_int4_lossless(w)
    assert packed is not None
    x = torch.randn(3, 256).to(torch.bfloat16)
    dense = x.float() @ w.t()
    assert torch.allclose(int4_linear(x, packed).float(), dense, atol=0.05, rtol=0.02)


def test_a_weight_off_any_4bit_grid_is_not_packed() -> None:
    assert pack_int4_lossless(torch.randn(96, 256)) is None


def test_bundled_model_single_stream_matches_the_dense_path() -> None:
    def run(int4_max_rows: int) -> tuple[list[int], int]:
        engine = LLMEngine(
            EngineConfig(model_path=bundled_model_path(), dtype="bfloat16", int4_max_rows=int4_max_rows,
                         cache=CacheConfig(num_blocks=64)),
            progress=False,
        )
        tok = engine.tokenizer
        assert tok is not None
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                            add_special_tokens=False)
        out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
        packed = sum(len(layer.int4) for layer in engine.loaded.model.layers)
        assert "Paris" in tok.decode(out)
        return out, packed

    dense, none_packed = run(0)
    quant, packed = run(4)
    assert none_packed == 0 and packed == 4 * 30  # every layer matrix of the Q4_1 file repacks
    assert quant == dense
