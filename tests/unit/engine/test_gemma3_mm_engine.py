"""The engine serving Gemma 3 (``Gemma3ForConditionalGeneration``) with image input,
against transformers' ``generate`` (tiny random fp32 model, tokens-only engine): greedy
ids and top-k logprobs of every step, one and two images, the bidirectional attention
within an image (a prefill chunk never splits one), prefix caching keyed by the image,
preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from common.errors import BadRequest  # noqa: E402
from common.multimodal import Gemma3ImageConfig, mm_hash  # noqa: E402
from common.protocol import GenerateRequest, MultiModalItem, SamplingParams  # noqa: E402
from tests.support.engine_helpers import make_engine  # noqa: E402
from tests.support.model_factory import _quiet_transformers  # noqa: E402
from worker.engine.models.config import ModelConfig  # noqa: E402

IMAGE, BOI, EOI = 300, 301, 302
TOKENS_PER_IMAGE = 4
N = 8  # generated tokens
TOP = 5


@pytest.fixture(scope="module")
def gemma(tiny_model):
    path = tiny_model("gemma3_mm")
    _quiet_transformers()
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    mc = ModelConfig.from_dir(path)
    return path, hf, Gemma3ImageConfig.for_model(mc.vision_config, mc.mm_tokens_per_image)


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40 + 7 * seed, 70, 3), dtype=np.uint8), "RGB")


def _prompt(cfg, seeds, seed=0, before=5, between=4, after=6, uint8=True):
    """Text around ``<start_of_image> IMAGE*4 <end_of_image>`` runs; the items (the resized
    uint8 images the gateway sends, or the float32 patches of vLLM's features form)."""
    rng = np.random.default_rng(seed)
    text = lambda k: [int(v) for v in rng.integers(3, 256, k)]  # noqa: E731
    ids, items = text(before), []
    for k, s in enumerate(seeds):
        if k:
            ids += text(between)
        ids.append(BOI)
        raw = np.ascontiguousarray(cfg.resize(_image(s)))
        patches, grid = cfg.patchify(raw)
        data, shape, enc = ((raw.tobytes(), list(raw.shape), "uint8_hwc") if uint8 else
                            (np.ascontiguousarray(patches, "<f4").tobytes(), list(patches.shape), "float32"))
        items.append(MultiModalItem(modality="image", mm_hash=mm_hash(raw, grid), offset=len(ids),
                                    length=TOKENS_PER_IMAGE, grid_thw=list(grid), pixel_values=data, shape=shape,
                                    encoding=enc))
        ids += [IMAGE] * TOKENS_PER_IMAGE
        ids.append(EOI)
    ids += text(after)
    return ids, items


def _req(rid, ids, items, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", N)
    params.setdefault("ignore_eos", True)
    params.setdefault("logprobs", TOP)
    return GenerateRequest(request_id=rid, prompt_token_ids=list(ids), params=SamplingParams(**params),
                           mm_items=items or None)


@torch.inference_mode()
def _hf_generate(hf, cfg, ids, seeds, bidirectional=True):
    """HF's greedy ids and per-step log-softmax rows; ``token_type_ids`` marks the image
    tokens as Gemma3Processor does (what opens the mask within each image)."""
    kw = {}
    if seeds:
        kw["pixel_values"] = torch.stack([
            torch.from_numpy(cfg.patchify(cfg.resize(_image(s)))[0]).view(4, 4, 3, 14, 14)
            .permute(2, 0, 3, 1, 4).reshape(3, 56, 56) for s in seeds])
        if bidirectional:
            kw["token_type_ids"] = (torch.tensor([ids]) == IMAGE).long()
    out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=N, min_new_tokens=N, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0, **kw)
    tokens = out.sequences[0, len(ids):].tolist()
    rows = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, rows


def _check(delta_list, ref):
    tokens, rows = ref
    got = [t for d in delta_list for t in d.token_ids]
    assert got == tokens
    lps = [d.logprobs for d in delta_list if d.logprobs is not None]
    top_ids = [r for lp in lps for r in lp.top_ids]
    top_lps = [r for lp in lps for r in lp.top_logprobs]
    assert len(top_ids) == N
    for t, row in enumerate(rows):
        ref_top = torch.topk(row, TOP)
        assert top_ids[t] == ref_top.indices.tolist(), t
        np.testing.assert_allclose(top_lps[t], ref_top.values.numpy(), atol=1e-4)


def _engine(path, **kw):
    kw.setdefault("tokens_only", True)
    return make_engine(path, **kw)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_one_and_two_images_match_hf_generate(gemma, backend):
    """Both CPU backends: torch SDPA builds the opened mask; the compiled kernels' backend
    runs steps with image spans on SDPA (text and decode steps on its kernels)."""
    path, hf, cfg = gemma
    cases = {"text": ([], 1), "one": ([1], 2), "two": ([1, 2], 3)}
    prompts = {k: _prompt(cfg, seeds, seed=s) for k, (seeds, s) in cases.items()}
    refs = {k: _hf_generate(hf, cfg, prompts[k][0], seeds) for k, (seeds, _) in cases.items()}
    engine = _engine(path, enable_prefix_caching=False, attention_backend=backend)
    assert engine.runner.backend.name == backend
    out = engine.generate([_req(k, ids, items) for k, (ids, items) in prompts.items()])
    for k in cases:
        _check(out[k], refs[k])
    assert engine.runner.encoder_cache.num_encoded == 2  # image 1 shared by "one" and "two"
    # the float32 patches (vLLM's features form) give the same outputs
    ids, items = _prompt(cfg, [1, 2], seed=3, uint8=False)
    _check(_engine(path, enable_prefix_caching=False).generate([_req("f", ids, items)])["f"], refs["two"])


def test_bidirectional_image_attention_is_what_hf_does(gemma):
    """HF without token_type_ids (a causal mask over the image) gives other logprobs: the
    engine's equality above holds because the mask is opened within each image."""
    path, hf, cfg = gemma
    ids, items = _prompt(cfg, [4], seed=6)
    bidir, causal = _hf_generate(hf, cfg, ids, [4]), _hf_generate(hf, cfg, ids, [4], bidirectional=False)
    assert max(float((a - b).abs().max()) for a, b in zip(bidir[1], causal[1])) > 1e-3
    _check(_engine(path, enable_prefix_caching=False).generate([_req("b", ids, items)])["b"], bidir)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_keeps_each_image_whole(gemma, async_scheduling):
    """5-token steps shared by two image requests: a chunk that would end inside an image
    (one token of budget left included) ends before it, so the image's tokens see each
    other (HF's outputs); images and text interleave over steps; the same with the next
    step planned while one is in flight (async scheduling)."""
    path, hf, cfg = gemma
    prompts = {"c": _prompt(cfg, [1, 2], seed=7, before=3, between=2, after=9),
               "d": _prompt(cfg, [3], seed=9, before=2, after=5)}
    refs = {"c": _hf_generate(hf, cfg, prompts["c"][0], [1, 2]), "d": _hf_generate(hf, cfg, prompts["d"][0], [3])}
    engine = _engine(path, enable_prefix_caching=False, max_num_batched_tokens=5, async_scheduling=async_scheduling)
    seen = []
    sched = engine.scheduler.schedule

    def spy():
        out = sched()
        seen.extend((s.seq.request.request_id, s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled
                    if s.seq.num_computed_tokens < s.seq.num_prompt_tokens)
        return out

    engine.scheduler.schedule = spy
    out = engine.generate([_req(k, ids, items) for k, (ids, items) in prompts.items()])
    for k in prompts:
        _check(out[k], refs[k])
    for rid, start, n in seen:  # no chunk boundary fell inside an image
        for it in prompts[rid][1]:
            assert not it.offset < start + n < it.offset + it.length, (rid, start, n, it.offset)
    assert len(seen) > 6 and any(n < 5 for _, _, n in seen)
    # an image longer than a step's budget could never be whole: refused at admission
    tight = _engine(path, enable_prefix_caching=False, max_num_batched_tokens=3)
    with pytest.raises(BadRequest, match="never split"):
        tight.add_request(_req("x", *prompts["c"]))


def test_prefix_cache_keys_the_image(gemma):
    """Image tokens at 30..33, blocks of 16: a repeat hits the first two blocks (the second
    holds half the image, its key folded in) and resumes inside the image, whose last
    tokens still see all of it (HF's outputs); the same text with another image hits the
    text-only first block alone."""
    path, hf, cfg = gemma
    ids_a, items_a = _prompt(cfg, [1], seed=8, before=29, after=10)
    ids_b, items_b = _prompt(cfg, [5], seed=8, before=29, after=10)
    assert ids_a == ids_b and items_a[0].mm_hash != items_b[0].mm_hash and items_a[0].offset == 30
    ref_a, ref_b = _hf_generate(hf, cfg, ids_a, [1]), _hf_generate(hf, cfg, ids_b, [5])
    engine = _engine(path, block_size=16)
    first = engine.generate([_req("a1", ids_a, items_a)])["a1"]
    other = engine.generate([_req("b1", ids_b, items_b)])["b1"]
    again = engine.generate([_req("a2", ids_a, items_a)])["a2"]
    assert first[0].num_cached_tokens == 0
    assert other[0].num_cached_tokens == 16  # the text block; the next one holds another image
    assert again[0].num_cached_tokens == 32  # up to the middle of the image
    _check(first, ref_a)
    _check(other, ref_b)
    _check(again, ref_a)


def test_preemption(gemma):
    """A KV budget smaller than the batch needs: preempted image requests are recomputed
    (their images whole in a chunk again) and still give HF's outputs."""
    path, hf, cfg = gemma
    prompts = [_prompt(cfg, seeds, seed=10 + i, after=20) for i, seeds in enumerate([[1], [2, 3], [4], [1, 5]])]
    refs = [_hf_generate(hf, cfg, ids, seeds) for (ids, _), seeds in zip(prompts, [[1], [2, 3], [4], [1, 5]])]
    engine = _engine(path, block_size=8, num_kv_blocks=12, max_num_batched_tokens=16, max_model_len=96)
    out = engine.generate([_req(str(i), ids, items) for i, (ids, items) in enumerate(prompts)])
    for i, ref in enumerate(refs):
        _check(out[str(i)], ref)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_causal_only_backends_are_refused(gemma, backend):
    path, _, _ = gemma
    with pytest.raises(ValueError, match="both ways"):
        _engine(path, attention_backend=backend)
