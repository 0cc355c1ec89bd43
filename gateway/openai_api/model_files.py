"""What the gateway reads from the model directory to render and derender text: the
tokenizer, its chat template, generation_config.json's sampling defaults, for a
``--render-only`` gateway with no workers to ask, the context length, and for a vision
model (Qwen2-VL family, Gemma 3) what image input needs (``ImageSpec``).

Only files are read (no weights): render/derender run on gateway processes, apart
from the GPUs, as vLLM's ``vllm launch render`` does.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from common.multimodal import Gemma3ImageConfig, Qwen2VLImageConfig
from common.tokenizer import Tokenizer, load_tokenizer
from gateway.chat.template import ChatTemplate

log = logging.getLogger("tokserve.gateway")

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
_GENERATION_DEFAULTS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                        "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class ImageSpec:
    """What the gateway needs to turn images into a model's input: the placeholder
    token, the vision tower's patch merge (Gemma 3: the projector's pooling kernel), the
    family's image processor (``Qwen2VLImageConfig`` / ``Gemma3ImageConfig``: the same
    operations) and, where the family's processor rewrites the prompt text, how."""

    image_token_id: int
    merge_size: int
    processor: Any
    model_id: str  # keys the images' content hashes (mm_hash) to this model
    # (marker, replacement): Gemma3Processor replaces each ``<start_of_image>`` of the rendered
    # prompt by ``\n\n<start_of_image>`` + the image tokens + ``<end_of_image>\n\n`` before
    # tokenizing; None: the template's placeholder token is expanded after (Qwen2-VL).
    text_expansion: Optional[tuple[str, str]] = None

    def expand_text(self, prompt: str) -> str:
        """The rendered prompt as the family's processor rewrites it before tokenizing."""
        if self.text_expansion is None:
            return prompt
        marker, replacement = self.text_expansion
        return prompt.replace(marker, replacement)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tokenizer: Any = None) -> Optional["ImageSpec"]:
        """None for a model without a vision tower (or without an image token)."""
        path = Path(model_dir)
        config = _read_json(path / "config.json")
        vision = config.get("vision_config")
        token = config.get("image_token_id", config.get("image_token_index"))
        if token is None:
            token = (config.get("text_config") or {}).get("image_token_id")
        if not isinstance(vision, dict) or not isinstance(token, int) or isinstance(token, bool):
            return None
        if config.get("model_type") == "gemma3":
            return cls._gemma3(path, config, vision, token, tokenizer)
        processor = Qwen2VLImageConfig.from_model_dir(path)
        merge = vision.get("spatial_merge_size", processor.merge_size)
        if not isinstance(merge, int) or merge < 1:
            raise ValueError(f"{path / 'config.json'}: vision_config.spatial_merge_size must be a positive integer")
        return cls(image_token_id=token, merge_size=merge, processor=processor, model_id=str(path.resolve()))

    @classmethod
    def _gemma3(cls, path: Path, config: dict, vision: dict, token: int, tokenizer: Any) -> "ImageSpec":
        tokens = int(config.get("mm_tokens_per_image") or 256)
        processor = Gemma3ImageConfig.from_model_dir(path, vision, tokens)
        expansion = None
        boi, eoi = config.get("boi_token_index", config.get("boi_token_id")), config.get(
            "eoi_token_index", config.get("eoi_token_id"))
        if tokenizer is not None and isinstance(boi, int) and isinstance(eoi, int):
            names = tokenizer.convert_ids_to_tokens([boi, token, eoi])
            if all(names):
                start, image, end = names
                expansion = (start, f"\n\n{start}{image * tokens}{end}\n\n")
        if expansion is None:
            raise ValueError(f"{path}: Gemma 3's image markers (boi/eoi/image token ids) are not in its tokenizer")
        return cls(image_token_id=token, merge_size=processor.merge_size, processor=processor,
                   model_id=str(path.resolve()), text_expansion=expansion)


@dataclass
class TextModel:
    """The model's text side, as the gateway needs it."""

    path: Path
    tokenizer: Tokenizer
    tokenizer_config: dict
    chat_template: Optional[ChatTemplate]
    chat_template_text: Optional[str]
    sampling_defaults: dict = field(default_factory=dict)
    max_position_embeddings: Optional[int] = None
    image: Optional[ImageSpec] = None  # None: a text-only model
    # Ids below this are the model's (vLLM's validate_token_ids bound): config.json's
    # vocab_size can exceed the tokenizer's (Qwen pads its embedding to 151,936 rows for
    # 151,665 tokens), and ids in that gap are valid, decoding to nothing.
    vocab_size: int = 0

    @classmethod
    def load(cls, model_dir: str | Path, chat_template: Optional[str] = None) -> "TextModel":
        path = Path(model_dir)
        config = _read_json(path / "config.json")
        eos = config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        tokenizer = load_tokenizer(path, eos_ids)
        if tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json: render, derender and the OpenAI routes need one")
        template = ChatTemplate.from_model_dir(path, chat_template)
        generation = _read_json(path / "generation_config.json")
        defaults = {ours: generation[key] for key, ours in _GENERATION_DEFAULTS.items() if key in generation}
        if defaults:
            log.info("default sampling parameters from generation_config.json: %s", defaults)
        max_pos = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
            "max_position_embeddings")
        model_vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        vocab_size = max(tokenizer.vocab_size, model_vocab if isinstance(model_vocab, int) else 0)
        return cls(path=path, tokenizer=tokenizer, tokenizer_config=_read_json(path / "tokenizer_config.json"),
                   chat_template=template, chat_template_text=template.template_for(None) if template else None,
                   sampling_defaults=defaults, max_position_embeddings=max_pos,
                   image=ImageSpec.from_model_dir(path, tokenizer), vocab_size=vocab_size)
