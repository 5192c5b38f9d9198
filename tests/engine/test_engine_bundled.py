"""The whole engine on the bundled SmolLM2 against Hugging Face transformers (fp32 greedy).

Each situation the engine must survive is shown to have happened: requests
one at a time, all together, prompts split into small prefill chunks, and a
KV pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hf_bundled import hf_bundled

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.detokenizer import IncrementalDetokenizer
from engine_native.engine import LLMEngine
from engine_native.messages import RequestOutput
from engine_native.model.bundled import bundled_model_path
from engine_native.model.loader import load_model
from engine_native.request import FinishReason
from engine_native.sampling_params import SamplingParams
from engine_native.step_trace import read_trace, summarize

NEW_TOKENS = 20

PROMPT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
    "Water boils at",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12),
    "Translate to French: I like apples.",
    " ".join(f"Item {i} costs {i * 3} dollars." for i in range(40)),
]


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    return load_model(bundled_model_path(), dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:  # type: ignore[no-untyped-def]
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    texts = PROMPT_TEXTS[:6] + [chat] + PROMPT_TEXTS[7:]  # the chat prompt replaces the translation one
    ids = [loaded.tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in ids}) >= 6, "prompts should differ in length"
    assert max(len(p) for p in ids) > 200
    return ids


@pytest.fixture(scope="module")
def hf_greedy(prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    model = hf_bundled(torch.float32)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model(input_ids=ids, use_cache=True)
            generated: list[int] = []
            for _ in range(NEW_TOKENS):
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            outputs.append(generated)
    return outputs


def make_engine(loaded, *, num_blocks: int = 512, block_size: int = 16, prefix_caching: bool = True,  # type: ignore[no-untyped-def]
                step_trace_path: str | None = None, **sched: int) -> LLMEngine:
    config = EngineConfig(
        model_path=bundled_model_path(),
        dtype="float32",
        step_trace_path=step_trace_path,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 512,
                                     "long_prefill_token_threshold": 512, **sched}),
    )
    return LLMEngine(config, loaded=loaded)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Run to completion, checking the KV invariant after every step."""
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id in got:  # other requests may share the engine
                got[out.request_id].extend(out.new_token_ids)
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [got[rid] for rid in ids]


def test_one_at_a_time_matches_hf(loaded, prompts, hf_greedy) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(loaded)
    for prompt, expected in zip(prompts, hf_greedy, strict=True):
        assert run_checked(engine, [prompt]) == [expected]


def test_all_together_matches_hf(loaded, prompts, hf_greedy) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(loaded)
    assert run_checked(engine, prompts) == hf_greedy
    assert engine.scheduler.num_preemptions == 0


def test_small_prefill_chunks_match_hf(loaded, prompts, hf_greedy) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(loaded, max_num_batched_tokens=48, long_prefill_token_threshold=16)
    assert run_checked(engine, prompts) == hf_greedy
    # every prompt longer than 16 tokens was split: at least ceil(len/16) - 1 non-sampling chunks each
    assert engine.scheduler.num_prefill_chunks >= sum(max(0, -(-len(p) // 16) - 1) for p in prompts)


def test_tiny_kv_pool_preempts_and_still_matches_hf(loaded, prompts, hf_greedy) -> None:  # type: ignore[no-untyped-def]
    # Every prompt fits at admission (one big step), but not the growth of all of them while decoding.
    prompt_blocks = sum(-(-len(p) // 8) for p in prompts)
    engine = make_engine(loaded, num_blocks=prompt_blocks + 2, block_size=8, max_num_batched_tokens=4096,
                         long_prefill_token_threshold=4096)
    assert run_checked(engine, prompts) == hf_greedy
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_and_changes_nothing(loaded, prompts, hf_greedy) -> None:  # type: ignore[no-untyped-def]
    system = prompts[7][:150]  # a long shared "system prompt"
    shared = [system + p for p in prompts[:4]]
    off = make_engine(loaded, prefix_caching=False)
    expected = [run_checked(off, [p])[0] for p in shared]
    on = make_engine(loaded)
    got = [run_checked(on, [p])[0] for p in shared]  # one at a time: each later one hits
    assert got == expected
    assert on.kv_cache.prefix_hits >= 3 * (150 // 16) * 16
    assert off.kv_cache.prefix_hits == 0
    # all together, after the cache is warm, and the plain prompts still match Hugging Face
    assert run_checked(on, shared) == expected
    assert run_checked(on, prompts) == hf_greedy


def test_seeded_sampling_is_independent_of_the_batch(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    engine = make_engine(loaded)
    alone = run_checked(engine, [prompts[0]], params)[0]
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    for i, p in enumerate(prompts[1:5]):
        engine.add_request(f"noise-{i}", p, noisy)
    together = run_checked(engine, [prompts[0]], params)[0]
    assert together == alone
    other_seed = run_checked(engine, [prompts[0]], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                                seed=99, ignore_eos=True))[0]
    assert other_seed != alone


def _stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("s", prompt, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs.extend(engine.step())
    return outs


def test_stop_string_across_tokens_cuts_the_stream(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(loaded)
    full = "".join(o.new_text for o in _stream(engine, prompts[2], SamplingParams(max_tokens=30, temperature=0)))
    tok = loaded.tokenizer
    # find a stop string that spans two tokens of the generated text
    ids = tok.encode(full, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    k = next(k for k in range(2, len(pieces)) if len(pieces[k - 1]) >= 2 and len(pieces[k]) >= 2)
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    assert stop in full
    outs = _stream(engine, prompts[2], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))
    text = "".join(o.new_text for o in outs)
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_chat_answer_is_right(loaded) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(loaded)
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                        add_special_tokens=False)
    outs = _stream(engine, prompt, SamplingParams(max_tokens=40, temperature=0))
    text = "".join(o.new_text for o in outs)
    assert "Paris" in text
    assert outs[-1].finish_reason == FinishReason.STOP  # stopped at <|im_end|>, not by length


@pytest.mark.parametrize("text", ["Emoji: 😀🎉👩‍👩‍👧 done", "中文字符测试，日本語もあります。", "mixed 😀 中 é ñ 🇫🇷"])
def test_multibyte_text_streams_without_broken_characters(loaded, text: str) -> None:  # type: ignore[no-untyped-def]
    tok = loaded.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=len(ids)))
    pieces = [detok.append(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p == "") > 0  # some tokens really were partial characters


@pytest.mark.parametrize("ending", ["length", "stop string", "abort"])
def test_idle_time_is_not_counted_as_prefill_time(loaded, prompts, ending) -> None:  # type: ignore[no-untyped-def]
    """Before: the first step after an idle spell counted the whole spell as its duration, so the
    prefill rate it reported was tiny and the gateway shed the next burst as if it would wait
    minutes (seen: 23 of 32 requests refused at 8 concurrent after a pause). The rate must be the
    step's own: at most its prompt tokens over the time the step call took, however the last request
    before the spell ended (its length, a stop string found after its step, an abort: the last two
    left the engine idle without a step saying so)."""
    engine = LLMEngine(
        EngineConfig(model_path=bundled_model_path(), cache=CacheConfig(num_blocks=256)), loaded=loaded,
        progress=False,
    )
    if ending == "length":
        engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))
    elif ending == "stop string":
        engine.add_request("probe", prompts[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        token = "".join(out.new_text for out in engine.step())
        first = token.strip()[:1] or token  # a stop string its first token completes
        assert first and not engine.has_unfinished
        engine.add_request("stopped", prompts[0], SamplingParams(max_tokens=4, temperature=0, stop=[first]))
        outputs = engine.step()
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("stopped", FinishReason.STOP)]
    else:
        engine.add_request("aborted", prompts[0], SamplingParams(max_tokens=50, temperature=0))
        engine.step()
        engine.abort(["aborted"])
    assert not engine.has_unfinished
    time.sleep(1.5)  # idle
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"burst-{i}", prompt, SamplingParams(max_tokens=2, temperature=0))
    longest = max(prompts, key=len)
    engine.add_request("long", longest * 3, SamplingParams(max_tokens=2, temperature=0))  # chunked: a backlog
    before = engine.prompt_tokens_total
    started = time.time()
    engine.step()
    took = time.time() - started
    computed = engine.prompt_tokens_total - before
    assert computed > 0
    assert engine.stats().prefill_tokens_per_s >= computed / took


def test_the_token_rates_span_the_steps_they_count(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    """stats() divides the window's tokens by the time from its first step's start. From that step's end,
    a prefill followed by one decode read as the prefill done in the decode's time (a prompt rate several
    times too high: too short a Retry-After, a spurious scale-up signal)."""
    engine = make_engine(loaded)
    longest = max(prompts, key=len)
    engine.add_request("r", longest, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    before = time.time()
    engine.step()  # the whole prompt: the bundled prompts are within the 512-token budget
    engine.step()  # one decode
    took = time.time() - before
    stats = engine.stats()
    assert engine.prompt_tokens_total == len(longest)
    assert stats.prompt_tokens_per_s <= len(longest) / took * 1.05  # 5%: the microseconds before the step's clock
    assert stats.generation_tokens_per_s <= 2 / took * 1.05


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    """The token that reaches max_tokens also completes a stop string: the text ends before the stop
    string, so the request stopped on it ("stop" and its stop string, as OpenAI and vLLM report), not
    on its length."""
    engine = make_engine(loaded)
    engine.add_request("probe", prompts[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    token = "".join(out.new_text for out in engine.step())
    stop = token.strip()[:1] or token
    engine.add_request("last", prompts[0], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, stop=[stop]))
    (out,) = engine.step()
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, stop)
    assert stop not in out.new_text


def test_a_burst_is_served_shortest_prompt_first(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    """Requests that arrive together start in the order of their prompts' lengths (the engine's default
    line, `SchedulerConfig.prompt_order_ms_per_token`), whatever order they were sent in."""
    engine = make_engine(loaded, max_num_seqs=1)  # one at a time: the line's order is the order of first tokens
    arrival = time.time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           arrival_time=arrival)
    first: list[str] = []
    while engine.has_unfinished:
        first.extend(out.request_id for out in engine.step() if out.request_id not in first)
    lengths = [len(prompts[int(rid.removeprefix("req-"))]) for rid in first]
    assert len(first) == len(prompts)
    assert lengths == sorted(lengths) and lengths != [len(p) for p in prompts]


def test_step_trace_accounts_for_every_step_and_token(loaded, prompts, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The trace a served engine writes (`--step-trace`) is what `sluice bench steps` reads to say which
    steps make the inter-token tail: every step is in it, and its counts add up to the engine's own."""
    path = tmp_path / "node-0.jsonl"
    engine = make_engine(loaded, step_trace_path=str(path), max_num_batched_tokens=48, long_prefill_token_threshold=16)
    engine.add_request("early", prompts[0], GREEDY)
    engine.step()
    engine.step()  # "early" decodes while the others' prompts arrive: steps of both kinds
    assert run_checked(engine, prompts[1:]) is not None
    engine.close()
    steps = read_trace(path)
    assert len(steps) == engine.steps
    assert sum(s.prefill_tokens for s in steps) == engine.prompt_tokens_total == sum(len(p) for p in prompts)
    assert sum(s.sampled for s in steps) == engine.generation_tokens_total == NEW_TOKENS * len(prompts)
    # every token after a request's first is a decode; the first is sampled by its prompt's last chunk
    assert sum(s.decodes for s in steps) == (NEW_TOKENS - 1) * len(prompts)
    assert sum(s.admitted for s in steps) == len(prompts)
    assert sum(s.first_gaps for s in steps) == len(prompts)  # one first inter-token gap a request
    assert {s.kind for s in steps} == {"prefill", "prefill+decode", "decode"}
    assert all(0 < s.forward_s <= s.interval_s for s in steps)
    assert [s.end for s in steps] == sorted(s.end for s in steps)
    summary = summarize(steps)
    assert summary.decode_gaps == (NEW_TOKENS - 1) * len(prompts)
    assert 0 < summary.gap_p50_s <= summary.gap_p99_s
