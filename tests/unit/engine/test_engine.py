"""Engine end to end on tiny random models: HF parity (greedy tokens, logprobs,
prompt logprobs), KV accounting, and request rejection."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import BadRequest
from tests.support.engine_helpers import (hf_greedy, hf_prompt_logprobs, make_engine, random_prompts, request,
                                  run_to_completion, tokens_of)

NUM_TOKENS = 10


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_with_staggered_arrivals(kind, tiny_model):
    model_dir = tiny_model(kind)
    engine = make_engine(model_dir)
    prompts = random_prompts(8, 3, 90, seed=1)
    out: dict = {}
    pending = list(enumerate(prompts))
    step = 0
    # Two requests join every other step while earlier ones are decoding or prefilling.
    while pending or engine.has_unfinished():
        if step % 2 == 0:
            for i, p in pending[:2]:
                engine.add_request(request(str(i), p, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3))
            pending = pending[2:]
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
        step += 1
    for i, p in enumerate(prompts):
        ref_tokens, ref_rows = hf_greedy(model_dir, p, NUM_TOKENS)
        deltas = out[str(i)]
        assert tokens_of(deltas) == ref_tokens, f"request {i} (prompt {len(p)} tokens)"
        assert deltas[-1].finish_reason == "length"
        assert all(d.num_prompt_tokens == len(p) for d in deltas)
        # Logprobs: sampled token's logprob and the top-3 match HF's log_softmax.
        lps = [d.logprobs for d in deltas if d.logprobs is not None]
        sampled_lp = [x for lp in lps for x in lp.logprobs]
        top_ids = [row for lp in lps for row in lp.top_ids]
        top_lps = [row for lp in lps for row in lp.top_logprobs]
        ranks = [r for lp in lps for r in lp.ranks]
        assert len(sampled_lp) == NUM_TOKENS and ranks == [1] * NUM_TOKENS
        for t, row in enumerate(ref_rows):
            ref_top = torch.topk(row, 3)
            assert top_ids[t] == ref_top.indices.tolist()
            np.testing.assert_allclose(top_lps[t], ref_top.values.numpy(), atol=1e-4)
            assert abs(sampled_lp[t] - float(row[ref_tokens[t]])) < 1e-4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and engine.scheduler.num_running == 0


def test_prompt_logprobs_and_token_id_scores_match_hf(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=16)  # the prompt is scored over chunks
    prompt = random_prompts(1, 40, 41, seed=3)[0]
    ids_rows = [[prompt[i + 1], 5, 7] for i in range(len(prompt) - 1)]
    res = engine.generate([request("p", prompt, max_tokens=2, prompt_logprobs=2,
                                   prompt_logprob_token_ids=ids_rows, kv_transfer_params={"k": 1})])
    d = res["p"][0]
    ref = hf_prompt_logprobs(llama_dir, prompt)
    plp = d.prompt_logprobs
    assert plp.token_ids == prompt[1:]
    np.testing.assert_allclose(plp.logprobs, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy(),
                               atol=1e-4)
    top = torch.topk(ref, 2)
    assert plp.top_ids == top.indices.tolist()
    np.testing.assert_allclose(plp.top_logprobs, top.values.numpy(), atol=1e-4)
    scores = np.frombuffer(d.prompt_token_id_scores, dtype=np.float32).reshape(d.prompt_token_id_shape)
    assert scores.shape == (len(prompt) - 1, 3)
    np.testing.assert_allclose(scores, ref.gather(1, torch.tensor(ids_rows)).numpy(), atol=1e-4)
    assert d.kv_transfer_params == {"k": 1}
    assert d.num_cached_tokens == 0


def test_blocks_freed_after_completion_and_abort(llama_dir):
    engine = make_engine(llama_dir)
    bm = engine.block_manager
    engine.add_request(request("a", list(range(3, 40)), max_tokens=50, ignore_eos=True, n=2, temperature=1.0))
    engine.add_request(request("b", list(range(50, 70)), max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    deltas = engine.abort("a")
    assert sorted((d.index, d.finish_reason) for d in deltas) == [(0, "abort"), (1, "abort")]
    assert engine.abort("a") == [] and engine.abort("unknown") == []
    rest = run_to_completion(engine)
    assert set(rest) == {("b", 0)} and rest[("b", 0)][-1].finish_reason == "length"
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    # Abort before the first step (choices not forked yet) also reports every choice.
    engine.add_request(request("c", [5, 6, 7], n=3, temperature=1.0))
    assert sorted(d.index for d in engine.abort("c")) == [0, 1, 2]
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_bad_requests_are_rejected_clearly(llama_dir):
    engine = make_engine(llama_dir, max_model_len=64)
    with pytest.raises(BadRequest, match="maximum model length") as e:
        engine.add_request(request("long", [5] * 65))
    assert e.value.status == 400
    # vLLM's generate endpoint accepts max_tokens past the context and stops at max_model_len.
    ctx = engine.generate([request("ctx", [5] * 60, max_tokens=10, ignore_eos=True)])["ctx"][0]
    assert ctx.finish_reason == "length" and len(ctx.token_ids) == 4
    with pytest.raises(BadRequest, match="out of vocabulary"):
        engine.add_request(request("oov", [5, 100_000]))
    engine.add_request(request("dup", [5, 6]))
    with pytest.raises(BadRequest, match="already"):
        engine.add_request(request("dup", [5, 6]))
    with pytest.raises(BadRequest):
        engine.add_request(request("temp", [5], temperature=-1.0))
    assert list(engine.requests) == ["dup"]


def test_model_info_and_load(qwen2_dir):
    engine = make_engine(qwen2_dir, served_model_name="tiny", max_model_len=128, num_kv_blocks=20)
    info = engine.model_info
    assert (info.name, info.max_model_len, info.max_num_seqs) == ("tiny", 128, 16)
    assert info.default_max_tokens == 32 and len(info.eos_token_ids) == 2 and info.has_tokenizer
    engine.add_request(request("x", [5, 6, 7]))
    load = engine.load()
    assert (load.waiting, load.running, load.total_kv_blocks, load.free_kv_blocks) == (1, 0, 20, 20)
    engine.step()
    assert engine.load().running == 1 and engine.load().free_kv_blocks == 19


def test_kv_cache_smaller_than_max_model_len_lowers_it(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=4, block_size=16, max_model_len=256)
    assert engine.max_model_len == 64 == engine.model_info.max_model_len


def test_runner_lays_out_mixed_batches(llama_dir):
    from worker.engine.records import Request, EngineSequence
    from worker.engine.core.scheduler import ScheduledSeq

    engine = make_engine(llama_dir, block_size=4)

    def seq(tokens, computed, blocks):
        req = request(f"s{len(tokens)}", tokens)
        s = EngineSequence(Request(req, arrival_seq=0, max_tokens=4, eos_token_ids=[], now=0.0), 0, list(tokens))
        s.num_computed_tokens, s.block_ids = computed, blocks
        return s

    decode = seq(list(range(10, 16)), 5, [3, 5])  # 1 new token at position 5
    chunk = seq(list(range(20, 30)), 2, [7, 2, 9])  # 6 new tokens at positions 2..7
    inputs = engine.runner.prepare([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 6)])
    assert inputs.input_ids.tolist() == [15, 22, 23, 24, 25, 26, 27]
    assert inputs.positions.tolist() == [5, 2, 3, 4, 5, 6, 7]
    assert inputs.attn.slot_mapping.tolist() == [5 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3]
    assert inputs.attn.query_start_loc.tolist() == [0, 1, 7]
    assert inputs.attn.seq_lens.tolist() == [6, 8] and inputs.attn.context_lens.tolist() == [5, 2]
    assert inputs.attn.block_tables.tolist() == [[3, 5, 0], [7, 2, 9]]
    assert (inputs.attn.max_query_len, inputs.attn.max_seq_len) == (6, 8)


def test_prompt_logprobs_carry_decoded_tokens_when_detokenizing(llama_dir):
    """vLLM fills ``decoded_token`` of prompt logprobs whenever detokenize is on (tokens
    mode too); with detokenize off it stays null."""
    engine = make_engine(llama_dir)
    prompt = [ord(c) for c in "Hello"]
    on = engine.generate([request("on", prompt, max_tokens=1, prompt_logprobs=1)])["on"][0].prompt_logprobs
    assert on.token_texts == list("ello")
    assert [len(row) for row in on.top_texts] == [1] * 4
    assert all(isinstance(t, str) for row in on.top_texts for t in row)
    off = engine.generate([request("off", prompt, max_tokens=1, prompt_logprobs=1,
                                   detokenize=False)])["off"][0].prompt_logprobs
    assert off.token_texts is None and off.top_texts is None


def test_engine_core_steps_without_wire_types(llama_dir):
    """The core hands out engine outputs; only Engine packs CompletionDeltas (same result)."""
    from tests.support.engine_helpers import make_engine
    from worker.engine import EngineConfig
    from worker.engine.core.engine_core import EngineCore
    from worker.engine.records import SequenceOutput
    from worker.engine.wire_output import merge_delta, to_delta

    core = EngineCore(EngineConfig(model=str(llama_dir), max_model_len=256, max_num_seqs=16, num_threads=1, dtype="float32"))
    core.add_request(request("a", [5, 6, 7, 8], max_tokens=5, ignore_eos=True, logprobs=1))
    merged = None
    while core.has_unfinished():
        for out in core.step():
            assert isinstance(out, SequenceOutput) and out.seq is not None
            merged = merge_delta(merged, to_delta(out))
    ref = make_engine(llama_dir).generate([request("a", [5, 6, 7, 8], max_tokens=5, ignore_eos=True,
                                                   logprobs=1)])["a"][0]
    assert merged.token_ids == ref.token_ids and merged.logprobs == ref.logprobs and merged.finish_reason == "length"
