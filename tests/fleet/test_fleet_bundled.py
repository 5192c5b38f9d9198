"""The bundled model behind the fleet: three `sluice worker --driver native` processes and a gateway.
Greedy streams through the fleet equal single-node output (one worker asked directly over the
wire), and still do when the worker serving one is killed with SIGKILL mid-stream: the request
resumes on another worker from the prompt plus the tokens already sent. The gateway tokenizes
with the workers' tokenizer once it has fetched it, so the later streams also check its ids.

One stream at a time: on a host with native bf16, a decode inside a step of more than
`quantized_max_rows` tokens runs through the bf16 GEMMs (docs/engine.md, "Numerics"), so a stream's
greedy tokens can change with what else shares its steps; equality with a solo reference is checked
on solo runs. Concurrent streams across a kill are
checked token for token on the synthetic engine (test_fleet_failover.py).

The workers run the dense weights in fp32 (`--dtype float32`): a resumed request is recomputed by the
dense GEMMs while the tokens before the kill came from the quantized blocks, and in fp32 the two hold the
same values and differ only in the order of additions. With bf16 dense weights (the default on a bf16 host)
the recompute rounds activations to bf16, and a near tie flipped the last tokens after the kill on an AMX
host in 5 of 7 runs (docs/engine.md, "Numerics").

Kept small for the suite's budget: 24 tokens, one engine thread per worker, steps slowed by 50 ms
so that the kill lands mid-stream."""

from __future__ import annotations

import signal

import httpx
import msgspec
from fleet_processes import Stream, gateway, nodes, wait_for, workers

from drivers.fleet import wire
from drivers.portable_tokenizer import SPEC_DECODER, fingerprint

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
PROMPTS = [
    "The three primary colours are",
    "Count: 1, 2, 3,",
    "The capital of France is",
    "Water boils at a temperature of",
]
NATIVE = ["--driver", "native", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
          "--fault-step-delay", "node-0=0.05"]


def single_node(url: str, prompt: str) -> str:
    """The worker's own greedy answer, asked directly: no fleet, no failover."""
    ids = httpx.post(url + wire.TOKENIZE_PATH, json={"model": MODEL, "prompt": prompt}, timeout=60).json()["token_ids"]
    body = wire.SubmitRequest(request_id=f"ref-{prompt}", model=MODEL, prompt_token_ids=ids,
                              sampling=wire.SamplingSpec(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    r = httpx.post(url + wire.GENERATE_PATH, content=msgspec.json.encode(body), timeout=120)
    events = [wire.STREAM_DECODER.decode(line) for line in r.text.splitlines()]
    return "".join(e.text for e in events if isinstance(e, wire.TokensEvent))


def test_greedy_through_the_fleet_equals_single_node_even_across_a_kill_9() -> None:
    with workers(3, *NATIVE, prefix="n", startup_timeout_s=300) as ws, \
            gateway("--workers", ",".join(w.url for w in ws), "--fleet-policy", "least-loaded") as base:
        wait_for("all three workers in the view", lambda: len(nodes(base)) == 3)
        # The native worker's tokenizer travels: named in its info, served whole, the same by fingerprint.
        named = httpx.get(ws[0].url + wire.INFO_PATH, timeout=10).json()["tokenizers"][MODEL]
        spec = httpx.get(ws[0].url + wire.TOKENIZER_PATH, params={"model": MODEL}, timeout=30)
        assert fingerprint(SPEC_DECODER.decode(spec.content)) == named
        reference = [single_node(ws[0].url, PROMPTS[0]), single_node(ws[1].url, PROMPTS[1]),
                     single_node(ws[2].url, PROMPTS[3])]
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, want in zip(PROMPTS[:2], reference, strict=False):
            s = Stream(base, {**body, "prompt": prompt}).start().join()
            assert (s.error, s.text, s.completion_tokens) == (None, want, MAX_TOKENS)
        # logit_bias travels to the worker's sampler: the first id of "banana" ("ban") forced three times.
        forced = httpx.post(ws[0].url + wire.TOKENIZE_PATH, json={"model": MODEL, "prompt": "banana"},
                            timeout=60).json()["token_ids"][0]
        s = Stream(base, {**body, "prompt": PROMPTS[2], "max_tokens": 3, "logit_bias": {str(forced): 100}}).start().join()
        assert (s.error, s.text) == (None, "ban" * 3)
        # The last one loses its worker mid-stream.
        s = Stream(base, {**body, "prompt": PROMPTS[3]}).start()
        assert s.started.wait(120)
        busy = max(nodes(base), key=lambda n: int(str(n["in_flight"])))
        assert int(str(busy["in_flight"])) == 1
        next(w for w in ws if w.worker_id == busy["id"]).signal(signal.SIGKILL)
        s.join()
        assert s.error is None, s.error
        assert (s.text, s.completion_tokens) == (reference[2], MAX_TOKENS)
