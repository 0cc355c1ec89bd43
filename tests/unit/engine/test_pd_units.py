"""P/D disaggregation in one process (worker/engine/disagg/kv_transfer.py): what add_request
refuses, plain params still echoed, and a decode leg aborted while its pull is in
flight leaves nothing behind (the late reply is dropped)."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from common.errors import BadRequest
from common.transfer_peers import TRUST_PEERS
from tests.support.engine_helpers import make_engine, request

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = make_engine(llama_dir, num_kv_blocks=32, kv_transfer_enabled=True)  # --kv-transfer-config
    yield eng
    eng.close()


def _decode_params(port: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e" * 32,
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": port,
            "remote_block_ids": [[0, 1]], "tp_size": 1}


def test_refusals(engine):
    kv = {"do_remote_decode": True}
    for req, words in ((request("a", PROMPT, kv_transfer_params=kv, n=2, temperature=1.0), "n=1"),
                       (request("a2", PROMPT, kv_transfer_params={"do_remote_prefill": True}), "remote_engine_id"),
                       (request("b", PROMPT, kv_transfer_params={"do_remote_decode": True,
                                                                 "do_remote_prefill": True}), "both")):
        with pytest.raises(BadRequest, match=words):
            engine.add_request(req)
    lora = request("c", PROMPT, kv_transfer_params=kv)
    lora.lora_name = "adapter"
    with pytest.raises(BadRequest, match="LoRA"):
        engine.add_request(lora)
    assert not engine.has_unfinished()


def test_other_params_are_echoed(engine):
    out = engine.generate([request("e", PROMPT, max_tokens=2, kv_transfer_params={"k": 1})])["e"][0]
    assert out.kv_transfer_params == {"k": 1}


def test_abort_while_pulling_leaks_nothing(engine):
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # receives the PULL, answers late
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    free = engine.block_manager.num_free_blocks
    req = request("d", PROMPT, max_tokens=4, kv_transfer_params=_decode_params(port))
    req.transfer_trust = TRUST_PEERS  # as the broker forwards it after checking the peer
    engine.add_request(req)
    assert engine.has_unfinished() and "d" in engine.kv_transfer.pending
    assert silent.poll(3000)
    ident, _ = silent.recv_multipart()
    deltas = engine.abort("d")
    assert [d.finish_reason for d in deltas] == ["abort"] and not engine.has_unfinished()
    silent.send_multipart([ident, b"\x81\xa2ok\xc2"])  # {"ok": false}: too late, dropped
    time.sleep(0.2)
    engine.tick()
    assert not engine.kv_transfer.pending and not engine.take_request_errors()
    assert engine.block_manager.num_free_blocks == free
    silent.close(0)


def test_a_prefill_leg_overlaps_and_holds_exactly_its_prompt_blocks(llama_dir):
    """Under async scheduling a prefill leg's steps overlap (its held full prompt blocks
    are written only by its prefill; a step in flight at its finish writes past the
    prompt): the answer names the same blocks, holding the same KV, as the synchronous
    step's -- a leg of several tokens beside plain requests, so steps are in flight when
    it finishes."""
    held = {}
    for mode in (False, True):
        eng = make_engine(llama_dir, num_kv_blocks=32, kv_transfer_enabled=True, async_scheduling=mode)
        try:
            out = eng.generate([request("p", PROMPT, max_tokens=5, ignore_eos=True,
                                        kv_transfer_params={"do_remote_decode": True}),
                                request("x", PROMPT[:9], max_tokens=9, ignore_eos=True)])
            kv = out["p"][0].kv_transfer_params
            blocks = kv["remote_block_ids"][0]
            assert len(blocks) == len(PROMPT) // eng.block_manager.block_size
            cache = eng.runner.kv_cache
            held[mode] = (out["p"][0].token_ids, cache[:, :, blocks].clone())
            if mode:
                assert eng.step_counts.get("overlapped", 0) >= 5 and not eng.step_counts.get("synchronous"), \
                    eng.step_counts
        finally:
            eng.close()
    assert held[True][0] == held[False][0]
    assert torch.equal(held[True][1], held[False][1])
