"""The engine's wire: reasons cross the pipe as enums and come back as enums, not bare ints or flags."""

from __future__ import annotations

import msgspec
import pytest

from engine_native import errors
from engine_native.messages import (
    AddRejected,
    EngineMessage,
    FinishReason,
    RejectReason,
    RequestOutput,
    StepOutputs,
)

decoder = msgspec.msgpack.Decoder(EngineMessage)


def test_finish_and_reject_reasons_round_trip_as_enums() -> None:
    out = RequestOutput(request_id="r", new_token_ids=[1], new_text="a", num_prompt_tokens=3,
                        num_output_tokens=1, token_time=1.0, finish_reason=FinishReason.LENGTH)
    decoded = decoder.decode(msgspec.msgpack.encode(StepOutputs([out])))
    assert isinstance(decoded, StepOutputs)
    assert decoded.outputs[0].finish_reason is FinishReason.LENGTH
    rejected = decoder.decode(msgspec.msgpack.encode(
        AddRejected(request_id="r", reason=RejectReason.QUEUE_FULL, message="full")
    ))
    assert isinstance(rejected, AddRejected) and rejected.reason is RejectReason.QUEUE_FULL


def test_an_unknown_reason_is_refused_at_the_wire() -> None:
    bad = msgspec.msgpack.encode({"type": "rejected", "request_id": "r", "reason": "tired", "message": ""})
    with pytest.raises(msgspec.ValidationError, match="reason"):
        decoder.decode(bad)


def test_the_error_hierarchy() -> None:
    assert issubclass(errors.QueueFullError, errors.RequestRejectedError)
    assert issubclass(errors.InvalidRequestError, errors.RequestRejectedError)
    assert issubclass(errors.RequestRejectedError, errors.EngineError)
    assert issubclass(errors.EngineDeadError, errors.EngineError)
    assert not issubclass(errors.EngineDeadError, errors.RequestRejectedError)


def test_the_tenant_weight_crosses_the_pipe() -> None:
    from engine_native.messages import AddRequest, ClientMessage
    from engine_native.sampling_params import SamplingParams

    msg = AddRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2),
                     arrival_time=0.0, tenant_id="t", tenant_weight=2.5)
    decoded = msgspec.msgpack.Decoder(ClientMessage).decode(msgspec.msgpack.encode(msg))
    assert isinstance(decoded, AddRequest) and (decoded.tenant_id, decoded.tenant_weight) == ("t", 2.5)
