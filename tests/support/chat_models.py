"""Tokenizer-only model folders for the real chat templates in tests/support/data/chat_templates
(sources in its README): a small byte-level BPE trained here on a few lines, with each template's
control tokens as special tokens (one id each, as in the released tokenizer), the template in
tokenizer_config.json and a config.json the gateway reads max_model_len from.  Nothing is
downloaded; transformers' AutoTokenizer loads the same folder as the reference."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

CORPUS = [
    "You are a helpful assistant. Answer briefly and politely.",
    "What's the weather like in Paris today? It is sunny and 21 degrees.",
    "Given the following functions, please respond with a JSON for a function call.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "The capital of France is Paris. The answer is 42. Thanks, hello world!",
    "Knowledge cutoff: 2024-06 Current date: 2026-01-01 Reasoning: medium high low",
    "function description parameters properties required type object string enum",
    "I should call the tool first. Let me think about it step by step.",
]


@dataclass(frozen=True)
class TemplateModel:
    """One released model's chat template and the tokens it needs."""

    hf_id: str  # the model whose template it is (vLLM's example templates: the family they serve)
    template: str  # file name in TEMPLATES
    special: tuple[str, ...]  # control tokens: special, never split
    bos: Optional[str] = None
    eos: Optional[str] = None
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <think>, <tool_call>)
    tools: bool = True  # the template renders tools, tool calls and tool results
    # chat_template_kwargs the template reads, one request each (besides none)
    kwargs: tuple[dict, ...] = ()
    openai_content: bool = False  # vLLM hands it content as parts (it loops over message content)

    @property
    def source(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_LLAMA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>")
_MISTRAL = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
# GPT-OSS (o200k_harmony): harmony's formatting tokens
HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
           "<|end|>", "<|message|>", "<|call|>")

TEMPLATE_MODELS: tuple[TemplateModel, ...] = (
    TemplateModel("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b-instruct.jinja", _LLAMA,
                  bos="<|begin_of_text|>", eos="<|eot_id|>", kwargs=({"date_string": "01 Jan 2026"},)),
    TemplateModel("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-instruct-2407.jinja", _MISTRAL,
                  bos="<s>", eos="</s>"),
    TemplateModel("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b-instruct.jinja", _QWEN, eos="<|im_end|>",
                  plain=_QWEN_PLAIN),
    # Qwen3 and Qwen3-MoE (Qwen3-30B-A3B) release the same template
    TemplateModel("Qwen/Qwen3-0.6B", "qwen3-0.6b.jinja", _QWEN, eos="<|im_end|>", plain=_QWEN_PLAIN,
                  kwargs=({"enable_thinking": False}, {"enable_thinking": True})),
    TemplateModel("openai/gpt-oss-120b", "openai-gpt-oss-120b.jinja", HARMONY, bos="<|startoftext|>",
                  eos="<|return|>", kwargs=({"reasoning_effort": "high"}, {"model_identity": "You are tiny."})),
    TemplateModel("HuggingFaceTB/SmolLM3-3B", "HuggingFaceTB-SmolLM3-3B.jinja", _QWEN, eos="<|im_end|>",
                  plain=("<think>", "</think>"), tools=False, kwargs=({"enable_thinking": False},)),
    TemplateModel("zai-org/GLM-4.6", "zai-org-GLM-4.6.jinja",
                  ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
                  eos="<|endoftext|>",
                  plain=("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                         "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"),
                  kwargs=({"enable_thinking": False},)),
    TemplateModel("deepseek-ai/DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.1.jinja",
                  ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                   "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
                  bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", plain=("<think>", "</think>"),
                  kwargs=({"thinking": True},)),
    TemplateModel("ibm-granite/granite-3.3-2b-instruct", "ibm-granite-granite-3.3-2b-instruct.jinja",
                  ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>", "<|start_of_cite|>",
                   "<|end_of_cite|>"), bos="<|end_of_text|>", eos="<|end_of_text|>", plain=("<think>", "</think>"),
                  kwargs=({"thinking": True},)),
    TemplateModel("microsoft/Phi-3.5-mini-instruct", "microsoft-Phi-3.5-mini-instruct.jinja",
                  ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                  bos="<s>", eos="<|endoftext|>", tools=False),
    # Released templates as GGUF conversions carry them (huggingface.js's ollama-utils automap)
    TemplateModel("google/gemma-3-1b-it", "google-gemma-3-1b-it.jinja",
                  ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
                  bos="<bos>", eos="<eos>", tools=False, openai_content=True),
    TemplateModel("deepseek-ai/DeepSeek-V3", "deepseek-ai-DeepSeek-V3.jinja",
                  ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                   "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>"),
                  bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"),
    # OLMo 2 writes its role tags as plain text; only <|endoftext|> is a control token
    TemplateModel("allenai/OLMo-2-1124-7B-Instruct", "allenai-OLMo-2-1124-7B-Instruct.jinja", ("<|endoftext|>",),
                  bos="<|endoftext|>", eos="<|endoftext|>", tools=False),
    TemplateModel("microsoft/phi-4", "microsoft-phi-4.jinja",
                  ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"), eos="<|im_end|>", tools=False),
    TemplateModel("microsoft/Phi-4-mini-instruct", "microsoft-Phi-4-mini-instruct.jinja",
                  ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"),
                  eos="<|endoftext|>"),
    # vLLM's example templates (tool-calling variants of the same families)
    TemplateModel("google/gemma-3-27b-it (vLLM examples/tool_chat_template_gemma3_pythonic.jinja)",
                  "vllm-tool_chat_template_gemma3_pythonic.jinja",
                  ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
                  bos="<bos>", eos="<end_of_turn>", openai_content=True),
    TemplateModel("microsoft/Phi-4-mini-instruct (vLLM examples/tool_chat_template_phi4_mini.jinja)",
                  "vllm-tool_chat_template_phi4_mini.jinja",
                  ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>"),
                  eos="<|endoftext|>"),
)


def _tokenizer(special: tuple[str, ...], plain: tuple[str, ...], extra_corpus: tuple[str, ...] = ()):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + list(extra_corpus), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tok


def write_model(spec: TemplateModel, out: Path, *, max_model_len: int = 8192,
                extra_config: Optional[dict] = None) -> Path:
    """A model folder (tokenizer.json, tokenizer_config.json, config.json) for ``spec``."""
    out.mkdir(parents=True, exist_ok=True)
    special = tuple(dict.fromkeys(spec.special + tuple(t for t in (spec.bos, spec.eos) if t)))
    tok = _tokenizer(special, spec.plain)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": t in special, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False}
             for t in special + spec.plain}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
              "chat_template": spec.source, "model_max_length": max_model_len,
              "bos_token": spec.bos, "eos_token": spec.eos}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    model_config = {"max_position_embeddings": max_model_len, "vocab_size": tok.get_vocab_size(),
                    **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(model_config), encoding="utf-8")
    return out


@dataclass
class Conversation:
    """A chat request's fields and the conversation vLLM hands transformers for it."""

    name: str
    messages: list
    tools: Optional[list] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)


def vllm_view(messages: list, openai_content: bool) -> list:
    """The messages as vLLM 0.33's preprocessing passes them to ``apply_chat_template``:
    null content as "" (or no parts), text as parts for templates that loop over content
    (tool results stay strings), tool-call arguments parsed into objects."""
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        content = m.get("content")
        if m["role"] != "tool" and openai_content:
            m["content"] = [] if content is None else [{"type": "text", "text": content}]
        elif content is None:
            m["content"] = ""
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(m)
    return out
