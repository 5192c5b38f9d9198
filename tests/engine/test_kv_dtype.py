"""Which dtype the KV cache takes when EngineConfig.kv_dtype leaves it open (engine.default_kv_dtype): bf16 for a
model computing in fp32 on the CPU when `dtype` is "auto" and Sluice's kernels attend over the cache, the model's
own dtype otherwise (an explicit "float32" keeps the cache fp32 too)."""

from __future__ import annotations

import pytest
import torch

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine, default_kv_dtype
from engine_native.model.bundled import bundled_model_path
from engine_native.model.quant import kernels_available
from engine_native.sampling_params import SamplingParams

# Where the kernels do not run (no AVX2 or no compiler) nothing attends over a bf16 cache faster: fp32 stays.
AUTO_FP32 = torch.bfloat16 if kernels_available() else torch.float32


def test_auto_fp32_on_the_cpu_stores_bf16_and_an_explicit_fp32_does_not() -> None:
    assert default_kv_dtype("auto", torch.float32, True, 64) == AUTO_FP32
    assert default_kv_dtype("float32", torch.float32, True, 64) == torch.float32
    assert default_kv_dtype("auto", torch.bfloat16, True, 64) == torch.bfloat16
    # Off the CPU the kernels are not the ones attending; a head_dim they cannot take keeps fp32.
    assert default_kv_dtype("auto", torch.float32, False, 64) == torch.float32
    assert default_kv_dtype("auto", torch.float32, True, 24) == torch.float32


@pytest.mark.parametrize(("dtype", "kv_dtype", "expected"), [
    ("auto", None, None),  # bf16 weights on a CPU with native bf16, fp32 ones elsewhere: a bf16 cache both
    ("float32", None, torch.float32),
    ("auto", "float32", torch.float32),
])
def test_the_engine_allocates_its_cache_in_that_dtype(dtype: str, kv_dtype: str | None,
                                                      expected: torch.dtype | None) -> None:
    engine = LLMEngine(EngineConfig(model_path=bundled_model_path(), dtype=dtype, kv_dtype=kv_dtype,
                                    cache=CacheConfig(num_blocks=16)), progress=False)
    auto = torch.bfloat16 if engine.loaded.dtype == torch.bfloat16 else AUTO_FP32
    assert engine.runner.kv_cache.k[0].dtype == (expected or auto)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[1, 2, 3]], [greedy])[0]) == 4  # and decodes over it
