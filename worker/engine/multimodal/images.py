"""Image input of vision-language models (Qwen2-VL / Qwen2.5-VL, Gemma 3) in the engine.

Per-family parts come through the model's image config (common/multimodal: patch
geometry, the uint8 image's patches) and the model (``encode_image``;
``image_attention == "bidirectional"``: Gemma 3's image tokens attend to each other, so
``prepare_step`` marks their spans on the step layout for the attention backend and
``whole_image_chunks`` keeps each image in one prefill chunk); M-RoPE positions only
where the model config has ``mrope_section``.

* ``check_mm_items`` validates a request's ``mm_items`` at admission (BadRequest,
  400) and ``MultiModalState`` keeps what its steps need: the decoded items and the
  prompt's M-RoPE positions and decode delta.
* ``EncoderCache``: image embeddings keyed by ``mm_hash``, LRU, bounded in tokens;
  an image is encoded once however many requests and prefill chunks use it.
* ``StepMultiModal.build``: for one step, the M-RoPE ``[3, T]`` positions (only when
  it prefills prompt tokens of an image request; otherwise the runner shifts the
  ``[T]`` positions by the delta, which keeps decode on the fast path) and the rows
  whose embeddings are (a slice of) an image's.
* KV-cache sizing on CUDA: ``dummy_vision_batch`` (the largest batch one vision-tower
  call can get, ``max_encode_grids``) and ``encoder_cache_bytes`` (a full cache), which
  ``ModelRunner._profile_cuda_blocks`` keeps out of the KV cache.
* ``MultimodalInputs``: the model runner's hook (``runner.hooks``): each step's
  positions and image embeddings, and the vision tower's part of the KV sizing.

Prefix caching: the block manager folds the cache key (``mm_hash`` + grid) of every
item overlapping a block into that block's hash (``MultiModalState.block_keys``, by
block, computed once per request and block size: ``block_mm_hashes``); the gateway
computes the same keys for routing (``common.prefix_hash.prompt_routing_hashes``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import msgspec
import numpy as np
import torch

from common.errors import BadRequest
from common.multimodal import Gemma3ImageConfig, Qwen2VLImageConfig, cache_key
from common.protocol import GenerateRequest, MultiModalItem
from worker.engine.models.mrope import mrope_positions

log = logging.getLogger(__name__)

_GIB = 1 << 30

DEFAULT_ENCODER_CACHE_TOKENS = 16384  # image embeddings kept (rows of hidden size)
# Patches per vision-tower call: a step's new images are encoded together (one set of
# GEMMs for all of them) in groups of at most this many patches, which bounds the
# tower's activation memory.
MAX_ENCODE_PATCHES = 32768
FLOAT32, UINT8_HWC, REMOTE = "float32", "uint8_hwc", "remote"


@dataclass
class MultiModalState:
    """Per request: its items (sorted by offset) and the prompt's M-RoPE positions."""

    items: list[MultiModalItem]  # mm_hash keyed with the grid (``_keyed``)
    positions: Optional[np.ndarray]  # [3, prompt_len] int64 (M-RoPE); None: plain positions (Gemma 3)
    delta: int  # positions of tokens past the prompt: index + delta
    prompt_len: int = 0
    wire_hashes: list[str] = dataclasses.field(default_factory=list)  # items' hashes as the request named them
    # Encoder outputs pulled from an encoder worker (disagg/ec_transfer.py), by keyed mm_hash:
    # the request's own, so a full encoder cache cannot evict them before its prefill.
    embeds: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    _block_keys: Optional[tuple[int, dict[int, tuple[str, ...]]]] = dataclasses.field(
        default=None, compare=False, repr=False)  # (block size, keys)

    def block_keys(self, block_size: int) -> dict[int, tuple[str, ...]]:
        """Block index -> the cache keys of the items overlapping that block (blocks
        without images absent): what prefix caching folds into each block's hash."""
        if self._block_keys is None or self._block_keys[0] != block_size:
            keys: dict[int, tuple[str, ...]] = {}
            if self.items:
                last = max(it.offset + it.length for it in self.items)
                for i in range(last // block_size + 1):
                    images = block_mm_hashes(self, i * block_size, (i + 1) * block_size)
                    if images:
                        keys[i] = images
            self._block_keys = (block_size, keys)
        return self._block_keys[1]


def check_mm_items(req: GenerateRequest, mc: Any, max_patches: Optional[int] = None,
                   image_config: Any = None) -> Optional[MultiModalState]:
    """Validate ``req.mm_items`` against the prompt and the model (BadRequest on any
    inconsistency); None for a request without items.  ``max_patches``: the patches of
    the largest image the model's preprocessor makes (what the KV sizing reserved the
    vision tower's memory for); larger items are refused."""
    items = req.mm_items
    if not items:
        if getattr(mc, "is_multimodal", False) and mc.image_token_id in req.prompt_token_ids:
            raise BadRequest(f"prompt position {req.prompt_token_ids.index(mc.image_token_id)} holds the image "
                             f"token {mc.image_token_id} but no item covers it (mm_items is empty)", "mm_items")
        return None
    if not getattr(mc, "is_multimodal", False):
        raise BadRequest(f"this model ({mc.architecture}) does not accept image input (it has no vision encoder)",
                         "mm_items")
    if req.kv_transfer_params is not None:
        raise BadRequest("kv_transfer_params: KV transfer is not supported for requests with images",
                         "kv_transfer_params")
    vc = mc.vision_config
    # The family's geometry (image_config_for): its processor's patch, merge (Gemma 3: the
    # projector's pooling kernel) and temporal patch sizes.
    geo = image_config if image_config is not None else image_config_for(None, vc, mc)
    merge, patch, temporal = geo.merge_size, geo.patch_size, geo.temporal_patch_size
    channels = int(vc.get("in_channels", vc.get("in_chans", vc.get("num_channels", 3))))
    patch_dim = channels * temporal * patch * patch
    prompt = req.prompt_token_ids
    n = len(prompt)
    ordered = sorted(items, key=lambda it: it.offset)
    prev_end = 0
    for k, it in enumerate(ordered):
        where = f"mm_items: item at offset {it.offset}"
        if it.modality != "image":
            raise BadRequest(f"mm_items: {it.modality!r} input is not supported yet (only images)", "mm_items")
        if not isinstance(it.mm_hash, str) or not it.mm_hash:
            raise BadRequest(f"{where}: mm_hash must be a non-empty string", "mm_items")
        if it.length <= 0 or it.offset < 0 or it.offset + it.length > n:
            raise BadRequest(f"{where}: placeholder range [{it.offset}, {it.offset + it.length}) lies outside "
                             f"the {n}-token prompt", "mm_items")
        if k and it.offset < prev_end:
            raise BadRequest(f"{where}: placeholder range overlaps the previous item's (ending at {prev_end})",
                             "mm_items")
        prev_end = it.offset + it.length
        if any(t != mc.image_token_id for t in prompt[it.offset:prev_end]):
            raise BadRequest(f"{where}: tokens in [{it.offset}, {prev_end}) are not all the image token "
                             f"{mc.image_token_id}", "mm_items")
        if len(it.grid_thw) != 3 or any(int(v) <= 0 for v in it.grid_thw):
            raise BadRequest(f"{where}: grid_thw must be three positive ints, got {list(it.grid_thw)}", "mm_items")
        t, h, w = (int(v) for v in it.grid_thw)
        if max_patches is not None and t * h * w > max_patches:
            raise BadRequest(f"{where}: grid_thw {[t, h, w]} is {t * h * w} patches, more than the {max_patches} of "
                             f"the largest image this model's preprocessor makes (max_pixels in its "
                             f"preprocessor_config.json)", "mm_items")
        if h % merge or w % merge:
            raise BadRequest(f"{where}: grid_thw {[t, h, w]} h and w must be multiples of {merge}", "mm_items")
        if it.length != t * h * w // (merge * merge):
            raise BadRequest(f"{where}: length {it.length} != t*h*w/{merge * merge} = "
                             f"{t * h * w // (merge * merge)} for grid_thw {[t, h, w]}", "mm_items")
        if it.encoding == UINT8_HWC:
            expected, itemsize = [h * patch, w * patch, channels], 1
            if t != 1:
                raise BadRequest(f"{where}: a uint8_hwc image has one frame, grid_thw {[t, h, w]} has {t}",
                                 "mm_items")
        elif it.encoding == FLOAT32:
            expected, itemsize = [t * h * w, patch_dim], 4
        elif it.encoding == REMOTE:  # embeddings pulled from an encoder worker (disagg/ec_transfer.py)
            expected, itemsize = [], 1
        else:
            raise BadRequest(f"{where}: unknown pixel encoding {it.encoding!r} (float32, uint8_hwc or remote)",
                             "mm_items")
        if list(it.shape) != expected:
            raise BadRequest(f"{where}: pixel_values shape {list(it.shape)} does not match grid_thw "
                             f"{[t, h, w]} (expected {expected} for {it.encoding})", "mm_items")
        if len(it.pixel_values) != (math.prod(expected) * itemsize if expected else 0):
            raise BadRequest(f"{where}: pixel_values holds {len(it.pixel_values)} bytes, shape {list(it.shape)} "
                             f"needs {math.prod(expected) * itemsize} ({it.encoding})", "mm_items")
    # Every run of image tokens must be exactly the items' ranges (M-RoPE splits runs by them).
    covered = np.zeros(n, dtype=bool)
    for it in ordered:
        covered[it.offset:it.offset + it.length] = True
    is_image = np.asarray(prompt, dtype=np.int64) == mc.image_token_id
    stray = np.flatnonzero(is_image & ~covered)
    if len(stray):
        raise BadRequest(f"mm_items: prompt position {int(stray[0])} holds the image token "
                         f"{mc.image_token_id} but no item covers it", "mm_items")
    positions, delta = None, 0
    if mc.mrope_section is not None:  # Qwen2-VL: M-RoPE positions; Gemma 3: plain ones
        try:
            mpos, delta = mrope_positions(prompt, [list(it.grid_thw) for it in ordered],
                                          image_token_id=mc.image_token_id, spatial_merge_size=merge)
        except ValueError as e:
            raise BadRequest(f"mm_items: {e}", "mm_items") from None
        positions = mpos.numpy()
    return MultiModalState([_keyed(it) for it in ordered], positions, delta, prompt_len=n,
                           wire_hashes=[it.mm_hash for it in ordered])


def _keyed(it: MultiModalItem) -> MultiModalItem:
    """The item with its grid folded into its ``mm_hash``: the encoder cache and the
    prefix-cache blocks are keyed by it, and a client naming one hash for images of
    different sizes (in one request or in one step) must not get another size's
    embeddings (a row-count mismatch that failed the whole step)."""
    return msgspec.structs.replace(it, mm_hash=cache_key(it.mm_hash, it.grid_thw))


def block_mm_hashes(state: Optional[MultiModalState], start: int, end: int) -> tuple[str, ...]:
    """mm_hashes of the items overlapping token range [start, end)."""
    if state is None:
        return ()
    return tuple(it.mm_hash for it in state.items if it.offset < end and it.offset + it.length > start)


def image_config_for(model_dir: Optional[str], vision_config: dict, mc: Any = None) -> Any:
    """The model's preprocessor config (rescale, mean/std) with the tower's patch geometry:
    a ``Qwen2VLImageConfig``, or for SigLIP towers (Gemma 3) a ``Gemma3ImageConfig``;
    both offer the operations the pipeline uses (common/multimodal).  ``mc``: the
    ModelConfig (its vision variant and Gemma 3's ``mm_tokens_per_image``)."""
    if mc is not None and mc.vision_variant == "siglip":
        if model_dir:
            return Gemma3ImageConfig.from_model_dir(model_dir, vision_config, mc.mm_tokens_per_image)
        return Gemma3ImageConfig.for_model(vision_config, mc.mm_tokens_per_image)
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir) if model_dir else Qwen2VLImageConfig()
    return dataclasses.replace(
        cfg, patch_size=int(vision_config.get("patch_size", vision_config.get("spatial_patch_size", cfg.patch_size))),
        merge_size=int(vision_config.get("spatial_merge_size", cfg.merge_size)),
        temporal_patch_size=int(vision_config.get("temporal_patch_size", cfg.temporal_patch_size)))


# --- memory profiling (KV-cache sizing on CUDA) ------------------------------------
# Shapes and arithmetic only, no device: ``ModelRunner._profile_cuda_blocks`` runs the
# dummy batch through the vision tower and measures the peak; tests run it on CPU.

_MAX_DUMMY_ASPECT = 4  # long side / short side of the dummy images (HF refuses > 200)


def _largest_grid(cells: int, window: int = 1) -> tuple[int, int]:
    """(rows, cols) of merged cells with rows * cols <= ``cells`` as large as possible
    (and cols <= 4 * rows); among equals, sides that tile ``window``-cell windows
    first, then the squarest.  (0, 0) when ``cells`` < 1."""
    best, key = (0, 0), None
    for r in range(1, math.isqrt(max(cells, 0)) + 1):
        c = min(cells // r, _MAX_DUMMY_ASPECT * r)
        k = (r * c, r % window == 0 and c % window == 0, r)
        if key is None or k > key:
            best, key = (r, c), k
    return best


def _geometry(vision_config: dict, image_config: Qwen2VLImageConfig) -> tuple[int, int]:
    vc = vision_config
    merge = int(vc.get("spatial_merge_size", image_config.merge_size))
    patch = int(vc.get("patch_size", vc.get("spatial_patch_size", image_config.patch_size)))
    return merge, patch


def max_image_grid(vision_config: dict, image_config: Qwen2VLImageConfig) -> tuple[int, int, int]:
    """``grid_thw`` of the largest image the preprocessor makes: ``smart_resize`` keeps
    sides multiples of ``patch * merge`` and the area within ``max_pixels``, so an
    image has at most ``max_pixels // (patch * merge)**2`` merged cells (one frame).
    Sides are multiples of the merge size; for Qwen2.5-VL they tile its attention
    windows when that costs no patches (clipped edge windows are valid either way)."""
    merge, patch = _geometry(vision_config, image_config)
    if image_config.fixed_grid is not None:  # every image resized to one size (Gemma 3)
        return image_config.fixed_grid
    factor = patch * merge
    cells = max(1, image_config.max_pixels // (factor * factor))
    window = max(1, int(vision_config.get("window_size", 0)) // factor)  # merged cells per window side
    rows, cols = _largest_grid(cells, window)
    return 1, rows * merge, cols * merge


def max_encode_grids(vision_config: dict, image_config: Qwen2VLImageConfig, token_budget: int,
                     max_patches: Optional[int] = None) -> list[tuple[int, int, int]]:
    """The grids of the largest batch one vision-tower call can get (``EncoderCache.fetch``).

    A step fetches the items its scheduled tokens overlap, so at most ``token_budget``
    images, each of at most ``max_image_grid`` patches (``P``); ``fetch`` groups them
    into calls of at most ``max_patches`` (default ``MAX_ENCODE_PATCHES``) patches, and
    a larger image goes alone.  One call therefore sees at most
    ``max(P, min(max_patches, token_budget * P))`` patches: that many as maximal
    images (the worst case for the tower's per-frame full attention), the remainder
    as one smaller image of whole merged cells.
    """
    if max_patches is None:
        max_patches = MAX_ENCODE_PATCHES
    merge, _ = _geometry(vision_config, image_config)
    big = max_image_grid(vision_config, image_config)
    per_image = math.prod(big)
    total = max(per_image, min(max_patches, max(1, token_budget) * per_image))
    grids = [big] * (total // per_image)
    rows, cols = _largest_grid((total - len(grids) * per_image) // (merge * merge))
    if rows:
        grids.append((1, rows * merge, cols * merge))
    return grids


def dummy_vision_batch(vision_config: dict, image_config: Qwen2VLImageConfig, token_budget: int,
                       max_patches: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``pixel_values`` ``[N, C*T*P*P]`` float32, ``grid_thw`` ``[images, 3]`` long) of
    ``max_encode_grids``, on the CPU (zeros: activation memory does not depend on the
    values)."""
    vc = vision_config
    _, patch = _geometry(vc, image_config)
    channels = int(vc.get("in_channels", vc.get("in_chans", 3)))
    temporal = int(vc.get("temporal_patch_size", image_config.temporal_patch_size))
    grids = max_encode_grids(vc, image_config, token_budget, max_patches)
    n = sum(math.prod(g) for g in grids)
    return torch.zeros(n, channels * temporal * patch * patch), torch.tensor(grids, dtype=torch.long)


def encoder_cache_bytes(max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory of a full encoder cache: ``max_tokens`` rows of ``hidden_size``."""
    return max_tokens * hidden_size * torch.empty((), dtype=dtype).element_size()


class EncoderCache:
    """Image embeddings by mm_hash, least recently used evicted past ``max_tokens``
    rows (an entry larger than that is still returned, just not kept)."""

    def __init__(self, model: Any, device: torch.device, max_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS,
                 image_config: Optional[Qwen2VLImageConfig] = None):
        self.model = model
        self.device = device
        self.max_tokens = max_tokens
        self.image_config = image_config or Qwen2VLImageConfig()
        # Patches of the largest image the preprocessor makes: admission refuses larger
        # items (the KV sizing reserved the tower's memory for this much).
        self.max_image_patches: Optional[int] = self.image_config.max_patches
        self._entries: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._tokens = 0
        self.num_encoded = 0  # images run through the vision tower (tests, metrics)
        # vllm:mm_cache_queries / _hits: one query per item a step needs (each prefill
        # chunk over an image asks again), a hit when its embeddings were cached.
        self.num_queries = 0
        self.num_hits = 0
        self.num_encode_calls = 0  # vision-tower calls (a step's new images share one)
        # An encoder worker's (disagg/ec_transfer.py): every output handed out is exported too.
        self.exports: Any = None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, item: MultiModalItem) -> torch.Tensor:
        return self.fetch([item])[item.mm_hash]

    def fetch(self, items: Sequence[MultiModalItem],
              provided: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Embeddings of ``items`` by mm_hash: cached ones as they are, ``provided`` ones
        (pulled from an encoder worker) cached, the rest encoded together (in groups of at
        most ``MAX_ENCODE_PATCHES`` patches) and cached."""
        out: dict[str, torch.Tensor] = {}
        missing: list[MultiModalItem] = []
        for it in items:
            if it.mm_hash in out:
                continue
            self.num_queries += 1
            emb = self._entries.get(it.mm_hash)
            if emb is not None and emb.shape[0] == it.length:
                self._entries.move_to_end(it.mm_hash)
                out[it.mm_hash] = emb
                self.num_hits += 1
            elif provided and it.mm_hash in provided:
                out[it.mm_hash] = provided[it.mm_hash]
                self._put(it.mm_hash, provided[it.mm_hash])
            elif it.encoding == REMOTE:  # admission pulled it; losing it is a bug, not bad input
                raise RuntimeError(f"no encoder output for pixel-less item {it.mm_hash!r}")
            elif all(m.mm_hash != it.mm_hash for m in missing):
                missing.append(it)
        group: list[MultiModalItem] = []
        patches = 0
        for it in missing:
            n = math.prod(int(v) for v in it.grid_thw)
            if group and patches + n > MAX_ENCODE_PATCHES:
                self._encode(group, out)
                group, patches = [], 0
            group.append(it)
            patches += n
        if group:
            self._encode(group, out)
        if self.exports is not None:
            for key, emb in out.items():
                self.exports.put(key, emb)
        return out

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def peek(self, key: str) -> torch.Tensor:
        """A cached entry, without counting a query or touching its recency."""
        return self._entries[key]

    def _pixels(self, item: MultiModalItem) -> torch.Tensor:
        if item.encoding == UINT8_HWC:
            image = torch.frombuffer(bytearray(item.pixel_values), dtype=torch.uint8).view(*item.shape)
            return self.image_config.torch_patches(image.to(self.device))
        array = np.frombuffer(item.pixel_values, dtype="<f4").reshape(list(item.shape))
        return torch.from_numpy(array.astype(np.float32)).to(self.device)

    def _encode(self, group: list[MultiModalItem], out: dict[str, torch.Tensor]) -> None:
        pixels = torch.cat([self._pixels(it) for it in group])
        grids = torch.tensor([list(it.grid_thw) for it in group], dtype=torch.long)
        embs = self.model.encode_image(pixels, grids)
        self.num_encoded += len(group)
        self.num_encode_calls += 1
        lengths = [it.length for it in group]
        if embs.shape[0] != sum(lengths):  # validated at admission; a mismatched tower config lands here
            raise RuntimeError(f"vision tower returned {embs.shape[0]} embeddings for items of {sum(lengths)} tokens")
        for it, emb in zip(group, embs.split(lengths)):
            if len(group) > 1:  # a view would keep the whole group's rows alive past its eviction
                emb = emb.clone()
            out[it.mm_hash] = emb
            self._put(it.mm_hash, emb)

    def _put(self, key: str, emb: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= old.shape[0]
        self._entries[key] = emb
        self._tokens += emb.shape[0]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.shape[0]
        if self._tokens > self.max_tokens:  # the only entry is too large to keep
            self._entries.clear()
            self._tokens = 0

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
        if self.exports is not None:
            self.exports.clear()


def prepare_step(scheduled: Sequence[Any], positions: np.ndarray, cache: EncoderCache,
                 spans: Optional[dict[int, list[tuple[int, int]]]] = None
                 ) -> tuple[Optional[np.ndarray], Optional[tuple[np.ndarray, list[torch.Tensor]]]]:
    """For a step's ``scheduled`` sequences (rows in order) and its ``[T]``
    positions: shifts, in place, the positions of image requests' tokens past their
    prompt by the M-RoPE delta; returns (``[3, T]`` positions or None when every
    token's three rows are equal or the model has no M-RoPE, (rows, embedding slices)
    or None).  ``spans``, when given, receives by sequence index the token ranges
    ``[offset, offset + length)`` of the images its chunk holds queries of (what
    bidirectional image attention opens)."""
    patches: list[tuple[int, np.ndarray]] = []  # (first row, [3, k] prompt positions)
    rows: list[np.ndarray] = []
    slices: list[tuple[MultiModalItem, int, int]] = []  # (item, first, end) embedding rows
    provided: dict[str, torch.Tensor] = {}  # pulled from an encoder worker
    t = 0
    for b, s in enumerate(scheduled):
        seq, n = s.seq, s.num_new_tokens
        state: Optional[MultiModalState] = seq.request.mm
        if state is None:
            t += n
            continue
        start = seq.num_computed_tokens
        end = start + n
        prompt_len = state.prompt_len
        if start < prompt_len:
            stop = min(end, prompt_len)
            if state.positions is not None:
                patches.append((t, state.positions[:, start:stop]))
            provided.update(state.embeds)
            for it in state.items:
                lo, hi = max(start, it.offset), min(end, it.offset + it.length)
                if lo >= hi:
                    continue
                if spans is not None:
                    spans.setdefault(b, []).append((it.offset, it.offset + it.length))
                slices.append((it, lo - it.offset, hi - it.offset))
                rows.append(np.arange(t + lo - start, t + hi - start, dtype=np.int64))
        if end > prompt_len and state.delta:
            first = max(start, prompt_len)
            positions[t + first - start:t + n] += state.delta
        t += n
    embeds: list[torch.Tensor] = []
    if slices:
        found = cache.fetch([it for it, _, _ in slices], provided)
        embeds = [found[it.mm_hash][a:b] for it, a, b in slices]
    pos3: Optional[np.ndarray] = None
    if patches:
        pos3 = np.broadcast_to(positions, (3, len(positions))).copy()
        for t0, p in patches:
            pos3[:, t0:t0 + p.shape[1]] = p
    mm = (np.concatenate(rows), embeds) if rows else None
    return pos3, mm


class MultimodalInputs:
    """Vision-language models' hook on the model runner (``runner.hooks``).

    Input contributor: image requests' decode positions shifted by their M-RoPE delta
    (in place, so decode keeps its CUDA graphs); steps prefilling their prompts run
    eagerly with ``[3, T]`` positions and the image embeddings.  Memory profile: the
    vision tower's peak on its largest batch and a full encoder cache."""

    def __init__(self, runner: Any, cache: EncoderCache):
        self.runner = runner
        self.cache = cache
        # The model's image tokens attend to each other both ways (Gemma 3, vLLM's mm-prefix LMs).
        self.bidirectional = getattr(runner.model, "image_attention", "causal") == "bidirectional"
        runner.encoder_cache = cache  # what the engine's features reach the cache through

    def contribute(self, scheduled: Sequence[Any], layout: Any, extras: Any) -> None:
        spans: Optional[dict[int, list[tuple[int, int]]]] = {} if self.bidirectional else None
        pos3, mm = prepare_step(scheduled, layout.positions, self.cache, spans)
        if pos3 is None and mm is None:
            return
        if spans:
            # The attention backend opens the causal mask within each image (Gemma 3):
            # the scheduler keeps every image whole in one chunk (``whole_image_chunks``).
            layout.attn_spans = spans
        extras.eager = True
        extras.positions = pos3
        mm_embeds = None
        if mm is not None:
            rows, embeds = mm
            mm_embeds = (torch.from_numpy(rows).to(self.runner.device), torch.cat(embeds))
        extras.model_kwargs["mm_embeds"] = mm_embeds

    # --- KV-cache sizing (MemoryProfileHook) -----------------------------------------
    def profile_reserve(self) -> int:
        """Bytes of a full encoder cache."""
        r = self.runner
        return encoder_cache_bytes(self.cache.max_tokens, r.model_config.hidden_size, r.dtype)

    def dummy_vision_run(self) -> tuple[int, int]:
        """Encode the largest batch one vision-tower call can get (``max_encode_grids``),
        as ``EncoderCache._encode`` does (per-image patches on the device, concatenated);
        returns (patches, embedding rows).  Nothing is cached."""
        r = self.runner
        pixels, grids = dummy_vision_batch(r.model_config.vision_config, self.cache.image_config, r.token_budget)
        sizes = [int(t * h * w) for t, h, w in grids.tolist()]
        on_device = torch.cat([p.to(r.device) for p in pixels.split(sizes)])
        del pixels
        embs = r.model.encode_image(on_device, grids)
        return on_device.shape[0], embs.shape[0]

    def profile_peak(self) -> int:
        """CUDA: the vision tower's activation peak (pixels, tower and embeddings) on the
        largest batch one call encodes."""
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        patches, rows = self.dummy_vision_run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        log.info("vision tower: %d patches (%d embeddings) in one call peak at %.2f GiB", patches, rows,
                 peak / _GIB)
        return max(peak, 0)


def whole_image_chunks(seq: Any, start: int, num_new: int) -> int:
    """The scheduler's chunk limit for models whose image tokens attend both ways
    (vLLM's ``disable_chunked_mm_input``, which it forces for its mm-prefix LMs): a
    prefill chunk ``[start, start + num_new)`` that would end inside an image ends
    before it instead, or is not run this step (0) when it starts inside the image (a
    prefix-cache hit ending there).  Admission refuses images longer than the step's
    token budget (``check_mm_items``), so every image fits a chunk of its own."""
    state: Optional[MultiModalState] = seq.request.mm
    if state is None:
        return num_new
    end = start + num_new
    for it in state.items:
        if it.offset < end < it.offset + it.length:
            return max(it.offset - start, 0)
    return num_new


def keeps_images_whole(runner: Any) -> bool:
    """Whether the runner's model attends both ways within an image (its chunks must not split one)."""
    return getattr(runner.model, "image_attention", "causal") == "bidirectional"


def install_chunking(ctx: Any, runner: Any) -> None:
    """The scheduler's chunk limit, for a model whose images must stay whole in a chunk."""
    if keeps_images_whole(runner):
        ctx.set_chunk_limit(whole_image_chunks)


def check_image_fits(state: Optional[MultiModalState], runner: Any) -> None:
    """An image longer than a step's token budget could never run whole: refused (400)."""
    if state is None or not keeps_images_whole(runner):
        return
    for it in state.items:
        if it.length > runner.token_budget:
            raise BadRequest(f"mm_items: the image at offset {it.offset} is {it.length} tokens, more than the "
                             f"{runner.token_budget} tokens of a step (--max-num-batched-tokens): this model's "
                             "image tokens attend to each other, so an image is never split across steps",
                             "mm_items")


def install(config: Any, ctx: Any, runner: Any) -> None:
    """Runner hook of a vision-language model: its image inputs and encoder cache."""
    mc = ctx.model_config
    if mc.is_multimodal:
        cache = EncoderCache(runner.model, ctx.device, image_config=image_config_for(config.model, mc.vision_config, mc))
        runner.install(MultimodalInputs(runner, cache))
