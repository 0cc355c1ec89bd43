"""The served model's weights in checkpoint (HF) naming: what a weight update may
name, writing new values in, reading them back (checksums), zeroing them.

The model keeps fused parameters (qkv, gate_up) and, on CPU, possibly packed copies of
its projections (cpu_gemm: oneDNN's or the native bf16 GEMM's).  Updates and reads go
through the same HF-name -> parameter-view map the loader uses (``weight_targets``); a
packed layer is unpacked (exactly) for the duration and packed again, one layer at a
time, so the extra memory is one layer's projections.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F

from common.dist_weight_transfer import weight_checksums
from common.errors import BadRequest

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> torch.bfloat16 (floating dtypes only)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BadRequest(f"unsupported weight dtype {name!r}: expected a floating dtype such as "
                         f"'bfloat16', 'float16' or 'float32'", "update_info")
    return dtype


class ModelWeights:
    """HF-named access to ``model``'s weights (tensor-parallel size 1)."""

    def __init__(self, model):
        self.model = model
        # build_model records the spec before packing; computing it later unpacks every layer.
        self.spec = getattr(model, "weight_spec", None) or weight_spec(model)
        self._left_dense: list = []  # layers written during an open update, packed again by pack()

    def _spec_of(self, model) -> dict[str, WeightSpec]:
        self.model, self._left_dense = model, []
        return self._spec()

    def _spec(self) -> dict[str, WeightSpec]:
        out: dict[str, WeightSpec] = {}
        for prefix, module in self._groups():
            with self._dense(module):
                for name, t in self._targets(prefix, module).items():
                    if module is not self.model and name.endswith(("q_norm.weight", "k_norm.weight")) and (
                            t.dim() == 2):  # OLMo's whole-projection norms are plain vectors
                        out[name] = WeightSpec((t.shape[1],), t.dtype)  # one [head_dim] row, broadcast per head
                    else:
                        out[name] = WeightSpec(tuple(t.shape), t.dtype)
        return out

    # --- structure -------------------------------------------------------
    def _groups(self) -> list[tuple[str, object]]:
        """(prefix, module) units that are unpacked/packed together: each decoder
        layer, then the model's own tensors (embedding, final norm, LM head)."""
        return [(f"model.layers.{i}.", layer) for i, layer in enumerate(self.model.layers)] + [("", self.model)]

    def _targets(self, prefix: str, module) -> dict[str, torch.Tensor]:
        if module is self.model:
            return self.model.own_weight_targets()
        return module.weight_targets(prefix)

    def canonical(self, name: str) -> str:
        """A checkpoint name in the model's terms: multimodal models accept both HF
        layouts (``model.language_model.*`` / ``model.visual.*`` and the older
        ``model.*`` / ``visual.*``), as their loader does."""
        rename = getattr(self.model, "checkpoint_name", None)
        return rename(name) if rename is not None else name

    def _group_of(self, name: str):
        m = _LAYER.match(name)
        if m is None:
            return "", self.model
        i = int(m.group(1))
        return f"model.layers.{i}.", self.model.layers[i]

    @contextlib.contextmanager
    def _dense(self, module, write: bool = False, keep_dense: bool = False):
        """Dense projection weights for the block; re-packed after a write (unless
        ``keep_dense``: an update in progress packs each layer once, in ``pack``)."""
        if module is self.model or module.packing is None or module.linear is F.linear:
            yield
            if write and module is self.model and self.model._lm_head_packed is not None:
                if keep_dense:
                    self._left_dense.append(module)
                else:
                    self.model.pack_lm_head()
            return
        module.unpack_linears()  # dense layers run with torch's GEMM meanwhile: still correct
        try:
            yield
        finally:
            if keep_dense:
                self._left_dense.append(module)
            else:
                self._pack(module)

    def _pack(self, module) -> None:
        if module is self.model:
            if self.model._lm_head_packed is not None:
                self.model.pack_lm_head()
            return
        module.pack_linears()

    def pack(self) -> None:
        """Pack the layers an update left dense (once each)."""
        left, self._left_dense = self._left_dense, []
        for module in {id(m): m for m in left}.values():
            self._pack(module)

    # --- checks ----------------------------------------------------------
    def check(self, entries: Iterable[tuple[str, str, list[int]]]) -> list[tuple[str, torch.dtype, tuple]]:
        """Validate (name, dtype name, shape) triples before any byte moves; returns
        them with torch dtypes.  Raises BadRequest naming the first problem."""
        out = []
        for name, dtype, shape in entries:
            name = self.canonical(name)
            spec = self.spec.get(name)
            if spec is None:
                hint = ", ".join(sorted(self.spec)[:3])
                raise BadRequest(f"unknown weight {name!r}: this model has no tensor of that name "
                                 f"(checkpoint names such as {hint}, ...)", "update_info")
            torch_dtype = dtype_from_name(dtype)
            shape = tuple(int(d) for d in shape)
            if shape != spec.shape:
                raise BadRequest(f"weight {name!r} has shape {list(shape)}, the model's is {list(spec.shape)}",
                                 "update_info")
            out.append((name, torch_dtype, shape))
        return out

    # --- write / read ----------------------------------------------------
    @torch.inference_mode()
    def write(self, tensors: dict[str, torch.Tensor], keep_dense: bool = False) -> None:
        """Copy checked tensors into the model (cast to its dtype), block by block."""
        tensors = {self.canonical(name): t for name, t in tensors.items()}
        by_group: dict[str, list[str]] = {}
        for name in tensors:
            by_group.setdefault(self._group_of(name)[0], []).append(name)
        for prefix, module in self._groups():
            names = by_group.get(prefix)
            if not names:
                continue
            with self._dense(module, write=True, keep_dense=keep_dense):
                targets = self._targets(prefix, module)
                for name in names:
                    targets[name].copy_(tensors[name])  # q/k_norm: one row broadcast over the heads

    @torch.inference_mode()
    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in checkpoint shapes, as the model holds them."""
        for prefix, module in self._groups():
            with self._dense(module):
                for name, t in self._targets(prefix, module).items():
                    if self.spec[name].shape != tuple(t.shape):
                        t = t[0]
                    yield name, t

    def checksums(self, prefix: str = "") -> dict[str, str]:
        """sha256 of every weight's bytes (vLLM's compute_tensor_digests, checkpoint names)."""
        return weight_checksums(self.read(), prefix)

    @torch.inference_mode()
    def zero(self) -> None:
        self.write({name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in self.spec.items()})


def weight_spec(model) -> dict[str, WeightSpec]:
    """Checkpoint name -> shape and dtype of every weight ``model`` holds."""
    return ModelWeights.__new__(ModelWeights)._spec_of(model)


def checkpoint_tensors(path: str, wanted: Optional[set[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    from worker.engine.loading.loader import iter_dense_checkpoint

    for name, tensor in iter_dense_checkpoint(path):
        if wanted is None or name in wanted:
            yield name, tensor
