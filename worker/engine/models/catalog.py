"""The user-facing list of supported architectures, read from the registry:
``tokserve models`` prints it, and docs/models.md's table is this module's
markdown output (a test keeps the two equal)."""
from __future__ import annotations

import argparse
import json

from worker.engine.models.registry import ModelRegistry, ModelFamily

COLUMNS = ("LoRA", "TP", "routed_experts", "images", "sliding window")


def _mark(on: bool) -> str:
    return "yes" if on else "-"


def rows() -> list[dict]:
    out = []
    for family in ModelRegistry.families():
        out.append({"architecture": family.architecture, "family": family.label, **family.supports(),
                    "lora_modules": list(family.lora_modules), "notes": family.notes})
    return out


def markdown_table() -> str:
    head = "| Architecture | Family | " + " | ".join(COLUMNS) + " | Notes |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for r in rows():
        cells = [f"`{r['architecture']}`", r["family"], *(_mark(r[c]) for c in COLUMNS), r["notes"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _family_line(family: ModelFamily) -> str:
    on = [k for k, v in family.supports().items() if v]
    return f"{family.architecture:<38} {family.label:<18} {', '.join(on) or '-'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokserve models",
                                description="list the model architectures this engine serves (HF config.json "
                                            "`architectures` names) and what each supports")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    args = p.parse_args(argv)
    if args.format == "json":
        print(json.dumps(rows(), indent=2))
    elif args.format == "markdown":
        print(markdown_table())
    else:
        print(f"{'architecture':<38} {'family':<18} supports")
        for family in ModelRegistry.families():
            print(_family_line(family))
        print(f"\n{len(ModelRegistry.get_supported_archs())} architectures")
    return 0
