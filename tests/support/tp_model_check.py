"""One rank of a model-level tensor-parallel check (run as a subprocess by
tests/integration/test_tensor_parallel.py): joins a gloo group, loads its shard, runs a fresh
prefill, a chunk after cached context beside a second prefill, and decode steps over
the paged cache, and (rank 0) writes the logits of every step to ``--out``."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from tests.unit.engine.test_model import PagedSeqs, _tokens
from worker.engine.loading.loader import load_model
from worker.engine.parallel.state import destroy_tensor_parallel, init_tensor_parallel

STEPS_A, STEPS_B = _tokens(30, seed=21), _tokens(12, seed=22)


def run_steps(model) -> list[torch.Tensor]:
    seqs = PagedSeqs(model)
    out = list(seqs.step([("a", STEPS_A[:18])]))
    out += seqs.step([("a", STEPS_A[18:26]), ("b", STEPS_B[:9])])
    for i in range(3):
        out += seqs.step([("a", [STEPS_A[26 + i]]), ("b", [STEPS_B[9 + i]])])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    init_tensor_parallel(args.rank, args.world, args.init, torch.device("cpu"))
    try:
        logits = run_steps(load_model(args.model))
        if args.rank == 0:
            np.save(Path(args.out), torch.cat(logits).numpy(), allow_pickle=False)
    finally:
        destroy_tensor_parallel()


if __name__ == "__main__":
    main()
