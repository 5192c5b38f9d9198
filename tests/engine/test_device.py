"""Device selection, dtype and KV / swap budgets, on CPU: CUDA's availability and free memory are
injected as the functions torch would answer with, so every branch runs without a GPU."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from engine_native.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_native.device import compute_dtype, resolve_device
from engine_native.engine import LLMEngine
from engine_native.model.attention_backends import resolve_backend_name
from engine_native.precision import parse_dtype
from engine_native.sizing import (
    DEFAULT_CUDA_SWAP_BYTES,
    kv_budget_bytes,
    kv_bytes_per_block,
    num_kv_blocks,
    num_swap_blocks,
)
from engine_native.swap import PreemptionCost

MODEL = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
)
GiB = 1024**3
CUDA = torch.device("cuda")


def yes() -> bool:
    return True


def no() -> bool:
    return False


def test_auto_is_cuda_only_where_torch_sees_one() -> None:
    assert resolve_device("auto", cuda_available=yes) == CUDA
    assert resolve_device("auto", cuda_available=no) == torch.device("cpu")
    assert resolve_device("cpu", cuda_available=yes) == torch.device("cpu")
    assert resolve_device("cuda:1", cuda_available=yes) == torch.device("cuda:1")


def test_cuda_without_a_gpu_and_unknown_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda", cuda_available=no)
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("tpu", cuda_available=yes)


def test_the_engine_refuses_cuda_before_loading_anything_on_a_cpu_build() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(ValueError, match="no CUDA device"):
        LLMEngine(EngineConfig(model_path="/nonexistent", device="cuda"))


def test_gpu_computes_in_bf16_by_default_and_cpu_as_before() -> None:
    assert compute_dtype("auto", CUDA) == torch.bfloat16
    assert compute_dtype("float32", CUDA) == torch.float32
    assert compute_dtype("auto", torch.device("cpu")) == parse_dtype("auto")


def test_cuda_kv_budget_is_a_fraction_of_free_device_memory_uncapped() -> None:
    config = EngineConfig(model_path="m", cache=CacheConfig(device_memory_fraction=0.5),
                          scheduler=SchedulerConfig(max_num_seqs=1024))
    per_block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    blocks = num_kv_blocks(config, MODEL, torch.bfloat16, 8192, device_memory=lambda: (40 * GiB, 141 * GiB))
    assert blocks == 20 * GiB // per_block  # beyond the 2 GiB the CPU default never exceeds
    # still never more than every running sequence at full context could use
    few = EngineConfig(model_path="m", scheduler=SchedulerConfig(max_num_seqs=2))
    assert num_kv_blocks(few, MODEL, torch.bfloat16, 8192, device_memory=lambda: (40 * GiB, 141 * GiB)) == 2 * 512
    # an explicit size wins over the device's memory
    sized = EngineConfig(model_path="m", cache=CacheConfig(memory_bytes=per_block * 7))
    assert num_kv_blocks(sized, MODEL, torch.bfloat16, 8192, device_memory=lambda: (40 * GiB, 141 * GiB)) == 7


def test_kv_fraction_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError):
        kv_budget_bytes(GiB, 1.5)


def test_host_swap_pool_exists_on_cuda_by_default_and_on_cpu_only_when_asked() -> None:
    per_block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    default = EngineConfig(model_path="m")
    assert num_swap_blocks(default, MODEL, torch.bfloat16, torch.device("cpu")) == 0
    assert num_swap_blocks(default, MODEL, torch.bfloat16, CUDA) == DEFAULT_CUDA_SWAP_BYTES // per_block
    asked = EngineConfig(model_path="m", cache=CacheConfig(swap_space_bytes=per_block * 3))
    assert num_swap_blocks(asked, MODEL, torch.bfloat16, torch.device("cpu")) == 3


def test_attention_backend_auto_is_native_on_cpu_and_a_cuda_backend_on_cuda() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu) == "native"
    assert resolve_backend_name("sdpa", cpu) == "sdpa"
    assert resolve_backend_name("auto", CUDA) in ("flashinfer", "sdpa")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend_name("native", CUDA)
    with pytest.raises(ValueError, match="flashinfer"):
        resolve_backend_name("flashinfer", cpu)
    assert resolve_backend_name("auto", CUDA, torch.float32) == "sdpa"  # FlashInfer has no fp32 kernels


def test_long_contexts_swap_and_short_ones_recompute_on_a_gpu() -> None:
    cost = PreemptionCost.for_device(MODEL, torch.bfloat16, CUDA)
    assert not cost.prefers_swap(16)
    assert cost.prefers_swap(8192)
    assert cost.recompute_s(4096) > 2 * cost.recompute_s(2048)  # attention makes recompute superlinear
