"""engine_native/precision.py: which dtype the engine computes in, decided without torch where the kernel
lists the CPU's flags, and the same as torch's own check on this host."""

from __future__ import annotations

import pytest
import torch

from engine_native.precision import ELEMENT_BYTES, dtype_name, native_bf16, parse_dtype


def test_the_kernels_cpu_flags_agree_with_torchs_check() -> None:
    assert native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("name", ["auto", "float32", "fp32", "bfloat16", "bf16"])
def test_a_name_resolves_to_the_same_dtype_with_and_without_torch(name: str) -> None:
    dtype = parse_dtype(name)
    assert str(dtype) == f"torch.{dtype_name(name)}"
    assert dtype.itemsize == ELEMENT_BYTES[dtype_name(name)]


def test_auto_is_bf16_only_where_the_cpu_computes_it() -> None:
    assert dtype_name("auto") == ("bfloat16" if native_bf16() else "float32")


@pytest.mark.parametrize("name", ["float16", "int8", "", "BF16"])
def test_other_names_are_refused_with_the_choices(name: str) -> None:
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16"):
        dtype_name(name)
