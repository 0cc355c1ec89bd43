"""Teacher-forced parity of our bf16 greedy outputs against a bf16 reference (HF
transformers, peft): the reference is run over our own output, and at every generated
position our token must be its argmax or a near-tie in its logits.  Shared by the
engine's bf16 parity tests (tests/unit/engine/test_bf16_engine.py) and the LoRA ones
(tests/unit/engine/test_lora_bf16.py); their docstrings state the tolerances and why."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 values (8 significant bits) at |x|."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


@dataclass
class TeacherForced:
    """What a check found: positions scored, agreements (our token is the reference's
    argmax or ties with it within one bf16 ulp: its bf16 logits cannot order them), the
    worst |our logprob - reference logprob|, and every mismatch (label, request, position, gap)."""
    positions: int = 0
    agree: int = 0
    worst_lp: float = 0.0
    mismatches: list = field(default_factory=list)

    def add(self, other: "TeacherForced") -> None:
        self.positions += other.positions
        self.agree += other.agree
        self.worst_lp = max(self.worst_lp, other.worst_lp)
        self.mismatches += other.mismatches


def teacher_forced(reference: Callable[[torch.Tensor], torch.Tensor], prompts: list[list[int]], outputs: dict,
                   num_tokens: int, near_tie: float, label: str = "") -> TeacherForced:
    """Score ``outputs`` (the engine's ``generate`` result keyed by request index, with
    logprobs=1) under ``reference`` (input ids ``[1, T]`` -> logits ``[1, T, V]``);
    asserts every mismatch is within ``near_tie`` of the reference's best logit."""
    found = TeacherForced()
    for i, p in enumerate(prompts):
        (delta,) = outputs[str(i)]
        ours = list(delta.token_ids)
        assert len(ours) == num_tokens
        with torch.inference_mode():
            logits = reference(torch.tensor([p + ours]))[0, len(p) - 1:-1].float()
        lps = torch.log_softmax(logits, dim=-1)
        for t, tok in enumerate(ours):
            found.positions += 1
            best = int(logits[t].argmax())
            gap = float(logits[t, best] - logits[t, tok])
            if gap <= bf16_ulp(float(logits[t, best])):
                found.agree += 1
            if best != tok:  # a mismatch must be a near-tie in the reference's own logits
                found.mismatches.append((label, i, t, gap))
                assert gap <= near_tie, f"{label} request {i} token {t}: ours {tok}, reference {best}, gap {gap:.4f}"
            found.worst_lp = max(found.worst_lp, abs(delta.logprobs.logprobs[t] - float(lps[t, tok])))
    return found


def bf16_model_and_truths(kind: str, root, n: int = 80, seed: int = 2):
    """``kind``'s bf16 checkpoint loaded as the engine serves it on CPU (bf16, the backend
    ``auto`` picks), ``n`` token ids, and the two references over them: transformers'
    float32 logits (the truth, same weights) and its own bf16 run's."""
    from tests.support.model_factory import load_hf_model, load_hf_model_bf16, tiny_bf16_model_dir
    from tests.unit.engine.test_model import _tokens
    from worker.engine.attention.selector import resolve_attention_backend
    from worker.engine.loading.loader import load_model

    path = tiny_bf16_model_dir(kind, root)
    model = load_model(path, dtype=torch.bfloat16)
    model.use_attention_backend(resolve_attention_backend("auto", "auto", torch.device("cpu"), torch.bfloat16, 4))
    ids = _tokens(n, seed=seed)
    with torch.inference_mode():
        truth = load_hf_model(path)(torch.tensor([ids])).logits[0].float()
        hf16 = load_hf_model_bf16(path)(torch.tensor([ids])).logits[0].float()
    return model, ids, truth, hf16
