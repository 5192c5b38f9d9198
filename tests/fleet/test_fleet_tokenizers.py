"""Prompts tokenized in the gateway with the workers' own tokenizer (drivers/portable_tokenizer.py,
drivers/fleet/tokenizers.py): the ids are the ones a worker answers, bad input is refused the same
way, and workers that disagree on the tokenizer get every prompt back to tokenize."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleet_processes import workers

from drivers.base import ChatMessage, GenerationRequest, InvalidRequestError
from drivers.fleet import wire
from drivers.fleet.client import WorkerClient, WorkerRefused
from drivers.fleet.config import FleetConfig
from drivers.fleet.driver import FleetDriver
from drivers.fleet.tokenizers import GatewayTokenizers
from drivers.fleet.wire import WorkerInfo, WorkerState
from drivers.portable_tokenizer import SPEC_DECODER, PromptTokenizer, encode_prompt, fingerprint, hf_spec
from engine_native.model.bundled import bundled_model_path
from engine_native.model.tokenizer_loader import load_tokenizer

CHAT = [ChatMessage("system", "You are terse."), ChatMessage("user", "Name three primary colours.")]


def _requests(model: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(request_id="p", model=model, prompt="The capital of France is"),
        GenerationRequest(request_id="e", model=model, prompt=""),
        GenerationRequest(request_id="u", model=model, prompt="naïve café — 東京 🚀  spaced\twords\n"),
        GenerationRequest(request_id="c", model=model, messages=CHAT),
        GenerationRequest(request_id="i", model=model, prompt_token_ids=[5, 17, 200]),
        GenerationRequest(request_id="l", model=model, prompt="word " * 3000),  # long: a worker thread
    ]


def test_the_bundled_tokenizer_travels_and_gives_the_engines_own_ids() -> None:
    tok = load_tokenizer(bundled_model_path())
    assert tok is not None
    spec = hf_spec(tok)
    assert spec is not None
    travelled = PromptTokenizer(SPEC_DECODER.decode(msgspec.json.encode(spec)))
    assert travelled.fingerprint == fingerprint(spec)
    for request in _requests("m"):
        assert travelled.prompt_ids(request) == encode_prompt(tok, request), request.request_id
    bad = GenerationRequest(request_id="b", model="m", messages=[ChatMessage("wizard", "hi")])
    with pytest.raises(InvalidRequestError) as here:
        travelled.prompt_ids(bad)
    with pytest.raises(InvalidRequestError) as engine:
        encode_prompt(tok, bad)
    assert (str(here.value), here.value.param) == (str(engine.value), engine.value.param)


def test_the_gateway_tokenizes_itself_once_it_holds_the_workers_tokenizer() -> None:
    with workers(2, "--driver", "synthetic") as ws:
        asyncio.run(_gateway_side([w.url for w in ws]))


async def _gateway_side(urls: list[str]) -> None:
    driver = FleetDriver(FleetConfig(workers=tuple(urls)))
    await driver.start()
    try:
        model = driver.models()[0].id
        requests = _requests(model)
        await driver.tokenize(requests[0])  # the first: asked of a worker while the tokenizer is fetched
        assert driver.tokenized_here == 0
        for _ in range(1200):  # a deadline that only catches a hang: the fetch is one small GET
            if driver.tokenizers.for_model(model, driver._ready_workers()) is not None:
                break
            await asyncio.sleep(0.05)
        assert driver.tokenizers.for_model(model, driver._ready_workers()) is not None, "the tokenizer never arrived"
        for request in requests:
            here = await driver.tokenize(request)
            asked = wire.TokenizeRequest(model=model, prompt=request.prompt, messages=request.messages,
                                         prompt_token_ids=request.prompt_token_ids)
            assert here == await driver.client.tokenize(urls[1], asked), request.request_id
        assert driver.tokenized_here == len(requests)
        # Out-of-vocabulary ids: refused here with the words the worker uses.
        bad = GenerationRequest(request_id="b", model=model, prompt_token_ids=[10**6])
        with pytest.raises(InvalidRequestError) as here_error:
            await driver.tokenize(bad)
        with pytest.raises(WorkerRefused) as worker_error:
            await driver.client.tokenize(urls[0], wire.TokenizeRequest(model=model, prompt_token_ids=[10**6]))
        assert str(here_error.value) == str(worker_error.value)
        # And a whole request through the fleet on gateway-made ids.
        chunks = [c async for c in driver.generate(msgspec.structs.replace(
            requests[0], max_tokens=4, tokenized_prompt=await driver.tokenize(requests[0])))]
        assert chunks[-1].finish_reason is not None and chunks[-1].completion_tokens == 4
    finally:
        await driver.stop()


def _worker(wid: str, tokenizer: str | None) -> WorkerInfo:
    return WorkerInfo(id=wid, address=f"http://127.0.0.1:1/{wid}", state=WorkerState.READY, incarnation=1,
                      models=[wire.ModelCard(id="m", max_model_len=64)],
                      tokenizers={"m": tokenizer} if tokenizer else {})


def test_workers_that_disagree_on_the_tokenizer_tokenize_every_prompt_themselves() -> None:
    async def check() -> None:
        held = GatewayTokenizers(WorkerClient(None, FleetConfig(workers=("x",)).timeouts))
        # Disagreeing fingerprints, or one worker whose tokenizer does not travel: nothing is fetched.
        assert held.for_model("m", [_worker("a", "f1"), _worker("b", "f2")]) is None
        assert held.for_model("m", [_worker("a", "f1"), _worker("b", None)]) is None
        assert held.for_model("other", [_worker("a", "f1")]) is None
        assert not held._fetching
        # Agreement starts a fetch; the address is unreachable, so none is held and none is retried at once.
        assert held.for_model("m", [_worker("a", "f1"), _worker("b", "f1")]) is None
        for _ in range(1200):
            if not held._fetching:
                break
            await asyncio.sleep(0.05)
        assert held.for_model("m", [_worker("a", "f1")]) is None and not held._fetching
        await held.aclose()
        await held.client.aclose()

    asyncio.run(check())
