"""The quantized-block path: the kernels compute with exactly the dense path's weight values, and a
model's greedy answers do not depend on which path a step took."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine
from engine_native.messages import LogprobEntry
from engine_native.model.bundled import bundled_model_path
from engine_native.model.gguf_file import read_gguf
from engine_native.model.quant import (
    Q41Weight,
    Q80Weight,
    dequantize,
    kernels_available,
    q4_1_from_gguf,
    q8_0_from_gguf,
    quant_linear,
)
from engine_native.sampling_params import SamplingParams


def test_the_kernels_build_on_this_host() -> None:
    assert kernels_available()  # CI hosts have AVX2 and g++: the fast path must not silently vanish


def test_the_guarded_sources_compile_for_the_other_kinds_of_cpu_too(tmp_path: Path) -> None:
    """The host's build compiles each ISA guard (AMX, AVX-512) one way only: an AMX host never compiles
    the code that stays when AMX is absent, an AVX2-only host never compiles the AVX-512 code, and the
    reverse. A type defined inside the AMX guard once broke every non-AMX build (kernels silently off
    there). Compile the guarded sources, syntax only, for each kind of CPU this host is not."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from engine_native.kernels import _HERE, _SOURCES

    flags = Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split()
    # x86-64-v3: AVX2 and FMA, neither AVX-512 nor AMX (both guards' other side); sapphirerapids: AVX-512,
    # its BF16 and AMX (both guards' code).
    marches = (["x86-64-v3"] if "avx512f" in flags else []) + ([] if "amx_bf16" in flags else ["sapphirerapids"])
    guarded = [s for s in _SOURCES if "SLUICE_HAVE_AMX" in s.read_text() or "__AVX512F__" in s.read_text()]
    assert marches and guarded
    # One translation unit of all of them, so that torch/extension.h (most of the time) is parsed once per
    # -march, not once per source: each took ~12 s here, all of them together ~14 s. The sources
    # keep their file-local names distinct for this (shared constants live in simd.h).
    unity = tmp_path / "guarded.cpp"
    unity.write_text("".join(f'#include "{s}"\n' for s in guarded))
    common = ["-std=c++17", "-fsyntax-only", "-fopenmp", f"-I{_HERE}",
              f"-I{sysconfig.get_paths()['include']}", *(f"-I{p}" for p in include_paths())]
    compilers = [subprocess.Popen(["g++", *common, f"-march={march}", str(unity)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for march in marches]
    for march, proc in zip(marches, compilers, strict=True):
        _, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if "error" in line]
        assert proc.returncode == 0, f"{[s.name for s in guarded]} for -march={march}: {errors[:5]}"


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path: Path) -> None:
    """A build killed mid-way leaves torch's `lock` file in the cache; torch alone then waits on it
    forever (a CI run hung on this). Copy the built cache, leave such a file, load again."""
    from engine_native import kernels

    built = kernels._build_dir()
    cache = tmp_path / "kernels"
    shutil.copytree(built, cache / built.name)  # same key: the copy is up to date, nothing recompiles
    (cache / built.name / "lock").write_text("")
    env = {**os.environ, "SLUICE_KERNEL_CACHE": str(cache)}
    probe = "from engine_native.kernels import cpu_kernels; print(cpu_kernels() is not None)"
    done = subprocess.run([sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.stdout.strip() == "True", done.stderr
    assert not (cache / built.name / "lock").exists()


@pytest.fixture(scope="module")
def bundled_tensors() -> dict[str, tuple[Q41Weight | Q80Weight, torch.Tensor]]:
    out = {}
    for t in read_gguf(bundled_model_path()).tensors:
        if t.name in ("blk.0.ffn_down.weight", "token_embd.weight"):
            blocks = q4_1_from_gguf(t.data) if t.tensor_type.name == "Q4_1" else q8_0_from_gguf(t.data)
            dense = torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
            out[t.name] = (blocks, dense)
    return out


def test_blocks_dequantize_to_exactly_the_dense_weights() -> None:
    """Every Q4_1 and Q8_0 tensor of the bundled model: the GGUF loader takes its dense weights from this."""
    checked = 0
    for t in read_gguf(bundled_model_path()).tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0"):
            blocks = q4_1_from_gguf(t.data) if t.tensor_type.name == "Q4_1" else q8_0_from_gguf(t.data)
            dense = torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert torch.equal(dequantize(blocks), dense), t.name
            checked += 1
    assert checked == 211


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 19])
@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight"])
def test_kernel_equals_the_dense_product_up_to_summation_order(bundled_tensors, name: str, rows: int) -> None:  # type: ignore[no-untyped-def]
    blocks, dense = bundled_tensors[name]
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ dense.double().t()
    ours = quant_linear(x, blocks).double()
    # fp32 accumulation over K <= 1536 terms: the dense GEMM's own error is of the same size.
    dense_err = ((x @ dense.t()).double() - exact).abs().max().item()
    assert (ours - exact).abs().max().item() <= max(4 * dense_err, 1e-5)


def test_bias_and_bf16_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (24, 4, 16), dtype=torch.uint8, generator=g)
    dm = torch.randn(24, 4, 2, generator=g) * 0.01
    w = Q41Weight(qs, dm)
    x = torch.randn(3, 128, generator=g).bfloat16()
    bias = torch.randn(24, generator=g)
    y = quant_linear(x, w, bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.float() @ dequantize(w).t() + bias), atol=0.02, rtol=0.01)


def _engine(quantized_max_rows: int | None, dtype: str = "auto", panel_max_rows: int | None = None) -> LLMEngine:
    """`quantized_max_rows` 0 and no `panel_max_rows`: the dense weights only; None: the default."""
    if panel_max_rows is None:
        panel_max_rows = EngineConfig.__dataclass_fields__["panel_max_rows"].default if quantized_max_rows != 0 else 0
    return LLMEngine(
        EngineConfig(model_path=bundled_model_path(), quantized_max_rows=quantized_max_rows, dtype=dtype,
                     panel_max_rows=panel_max_rows, cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)),
        progress=False,
    )


def _chat(engine: LLMEngine, question: str) -> list[int]:
    tok = engine.tokenizer
    assert tok is not None
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Who wrote Hamlet?",
    "Translate 'good morning' to Spanish.",
    "Give me a word that rhymes with cat.",
    "What colour is the sky on a clear day?",
]


def test_greedy_answers_are_the_same_on_both_paths_in_fp32() -> None:
    """In fp32 the blocks and the dense weights hold the same values: only the order of additions
    differs, and no greedy answer changes with the path."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    quantized = _engine(8, "float32")
    dense = _engine(0, "float32")
    assert quantized.loaded.model.enable_quantized(8) == 4 * 30 + 1  # every layer matrix and the lm_head
    prompts = [_chat(quantized, q) for q in QUESTIONS]
    alone = [quantized.generate([p], greedy)[0] for p in prompts]  # steps of 1 token: the blocks
    assert [dense.generate([p], greedy)[0] for p in prompts] == alone


def test_default_greedy_answers_are_the_same_alone_and_in_a_batch_of_8() -> None:
    """The default configuration (bf16 dense weights where the CPU has native bf16): a decode alone runs
    through the fp32 blocks; in a batch of 8 through the same blocks, except where the bf16 panels take
    decode steps of more than 2 sequences (AVX-512 BF16 without AMX), whose inputs are rounded to bf16.
    The prompts' prefill is one bf16 GEMM of all their rows, and on a CPU with AMX oneDNN picks its kernel
    by the row count (rows of a 37-row product differ in the last bits from the same rows inside a 301-row
    one; no packing hint changes that). Either way the batch may flip a greedy token where the two best
    are within rounding. A request's tokens are the same alone and in the batch of 8, except, at most,
    from a near tie on: less than 0.05 nats between the two best, the batch taking the other of the two."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    engine = _engine(EngineConfig.__dataclass_fields__["quantized_max_rows"].default)
    prompts = [_chat(engine, q) for q in QUESTIONS]
    assert len(prompts) == 8
    alone = [_greedy_with_top2(engine, p) for p in prompts]
    batch = engine.generate(prompts, greedy)
    assert [[e.token_id for e in a] for a in alone] == [engine.generate([p], greedy)[0] for p in prompts]
    assert _same_but_near_ties(alone, batch) >= 6
    tok = engine.tokenizer
    assert tok is not None and "Paris" in tok.decode(batch[0])


def _same_but_near_ties(alone: list[list[LogprobEntry]], batch: list[list[int]]) -> int:
    """How many requests' tokens in the batch are their tokens alone; the others may part from them only at a near
    tie (under 0.05 nats between the two best alone), the batch taking the other of the two."""
    same = 0
    for entries, got in zip(alone, batch, strict=True):
        tokens = [e.token_id for e in entries]
        if got == tokens:
            same += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(tokens, got, strict=False)) if a != b)
        best, second = entries[k].top[0], entries[k].top[1]
        assert best.logprob - second.logprob < 0.05, (k, best, second)  # a near tie, nothing more
        assert got[k] == second.token_id
    return same


def _greedy_with_top2(engine: LLMEngine, prompt: list[int], max_tokens: int = 16,
                     ignore_eos: bool = False) -> list[LogprobEntry]:
    engine.add_request("alone", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2,
                                                       ignore_eos=ignore_eos))
    entries: list[LogprobEntry] = []
    while engine.has_unfinished:
        for out in engine.step():
            entries.extend(out.logprobs or [])
    return entries


def test_the_fused_decode_step_gives_the_layer_by_layer_logits() -> None:
    """kernels/fused_decode.cpp runs a pure-decode step in one call; its logits equal the PyTorch
    path's (dense weights) up to the order of additions, and it writes the same K/V."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_model_support import PagedSequences

    from engine_native.model.loader import load_model

    loaded = load_model(bundled_model_path(), dtype=torch.float32, progress=False)
    model = loaded.model
    model.enable_quantized(8)
    seqs = PagedSequences(loaded.config, num_blocks=64, block_size=16, dtype=torch.float32, seed=3)
    prompts = [list(range(100, 137)), list(range(2000, 2021)), [5, 6, 7]]
    model.forward(seqs.step([(i, p) for i, p in enumerate(prompts)], last_only=True), seqs.cache)
    decode = seqs.step([(i, [300 + i]) for i in range(len(prompts))])
    assert model._fused_for(decode, seqs.cache) is not None  # this step takes the fused path
    fused = model.forward(decode, seqs.cache)
    k_fused = [k.clone() for k in seqs.cache.k]
    model.enable_quantized(0)  # the layer-by-layer PyTorch path, dense weights, same step again
    assert model._fused_for(decode, seqs.cache) is None
    layered = model.forward(decode, seqs.cache)
    torch.testing.assert_close(fused, layered, atol=2e-3, rtol=1e-4)
    assert torch.equal(fused.argmax(-1), layered.argmax(-1))
    for a, b in zip(k_fused, seqs.cache.k, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
