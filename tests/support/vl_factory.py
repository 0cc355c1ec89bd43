"""Tiny random Qwen2-VL / Qwen2.5-VL models built with transformers (the tests' reference)."""
from __future__ import annotations

import transformers


def hf_qwen2_vl(qwen2_5: bool, text_config: dict, vision_config: dict, *, image: int, video: int, vstart: int,
                vend: int):
    """An untrained ``Qwen2VLForConditionalGeneration`` (or the 2.5 one) in eval mode."""
    config_cls, model_cls = ((transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)
                             if qwen2_5 else (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration))
    cfg = config_cls(text_config=text_config, vision_config=dict(vision_config), image_token_id=image,
                     video_token_id=video, vision_start_token_id=vstart, vision_end_token_id=vend)
    return model_cls(cfg).eval()
