"""Frame layout helpers (common/framing.py): round trips and rejection of malformed input."""
from __future__ import annotations

import pytest

from common import framing
from common.framing import FrameError
from common.protocol import MAGIC, CompletionDelta, GenerateRequest, MsgType, Outputs, OutputsHeader, WorkerLoad


def test_round_trip_and_split():
    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], session_id="s")
    frames = framing.message(MsgType.GENERATE, req, b"client-id")
    msg_type, rest = framing.split(frames)
    assert msg_type == MsgType.GENERATE and rest[1] == b"client-id"
    assert framing.decode(rest[0], GenerateRequest) == req
    header = OutputsHeader(started=["r"], finished=[], load=WorkerLoad(running=1, num_received=3))
    assert framing.decode(framing.encode(header), OutputsHeader) == header
    out = Outputs([CompletionDelta("r", 0, [7], finish_reason="length")])
    assert framing.decode(framing.encode(out), Outputs) == out
    assert framing.nonce_from(framing.nonce_bytes(2**40 + 5)) == 2**40 + 5


@pytest.mark.parametrize("frames", [
    [],
    [MAGIC, MsgType.GENERATE],
    [b"TM0", MsgType.GENERATE, b""],
    [MAGIC, b"\x99", b""],
    [MAGIC, b"", b""],
])
def test_split_rejects_malformed(frames):
    with pytest.raises(FrameError):
        framing.split(frames)


def test_decode_rejects_garbage_and_wrong_types():
    with pytest.raises(FrameError):
        framing.decode(b"\xc1", GenerateRequest)
    with pytest.raises(FrameError):
        framing.decode(framing.encode(["r", "not-a-list"]), GenerateRequest)
    with pytest.raises(FrameError):
        framing.nonce_from(b"123")
    with pytest.raises(FrameError):
        framing.expect_count([b"a", b"b"], 1, "ABORT")
