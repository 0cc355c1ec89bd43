"""Which adapters exist, which are in host memory and which sit in the device slots.

- registry: every adapter a request may name (``--lora-modules`` and runtime loads),
  with its path; a load reads and validates the adapter at once, so a bad one is
  refused when it is loaded, not when a request first uses it.
- host cache: up to ``--max-cpu-loras`` adapters' tensors, least recently used
  dropped first (re-read from their path when needed again).  An adapter with
  unfinished requests is pinned there: it is read (again) when a request arrives,
  so a missing or broken file fails that request at once, never a later step.
- slots: ``--max-loras`` device slots.  The scheduler admits at most that many
  distinct adapters into the running set, so every step's adapters fit; a step
  puts a missing one into a slot no running sequence uses (least recently used).

Each registration gets a fresh key ("name#n"): requests resolve their adapter's
name to it when they arrive, and the prefix cache, host cache and slots work by
key.  So KV computed under an adapter is never shared with another one, nor with a
later adapter loaded under the same name, and an unloaded adapter keeps serving
the requests that already run with it.
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from common.errors import ServingError

from worker.engine.lora.adapter import MODEL, LoRAAdapter, load_adapter
from worker.engine.lora.batch import LoRABatch
from worker.engine.lora.weights import LayerLoRA, ModelLoRA

_MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


class LoRAError(ServingError):
    """A refused load/unload in vLLM's words, status and error type: 400 InvalidUserInput
    for the request checks of its /v1/load_lora_adapter, 404 NotFoundError for an
    unknown name or a path with no adapter, 400 BadRequestError for an adapter it
    cannot serve (vLLM answers those with a 500; a bad adapter is the client's)."""

    def __init__(self, message: str, status: int = 400, type: Optional[str] = None):
        super().__init__(message, None, status=status,
                         type=type or ("NotFoundError" if status == 404 else "BadRequestError"))


_INVALID = "InvalidUserInput"


class LoRAManager:
    def __init__(self, model, *, max_loras: int, max_rank: int, max_cpu_loras: Optional[int],
                 device: torch.device, dtype: torch.dtype, use_triton: bool):
        family = model.config.family
        if not family.lora_served:  # the registry says whose adapters these slots can serve
            raise ValueError(f"{family.architecture}: serving LoRA adapters is not implemented for this model "
                             f"family (its adapters target {', '.join(family.lora_modules)}); serve it without "
                             f"--enable-lora")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.device, self.use_triton = device, use_triton
        # The slots belong to the manager, not the model: a model rebuilt after a level-2
        # sleep gets the same slots (and their adapters) attached again.  On the CPU path
        # they are float32 whatever the model's dtype: peft serves a bf16 model's adapter
        # in float32 (from_pretrained's autocast_adapter_dtype), and bf16 slots would
        # round A and B * scaling where peft does not (batch.py's _add_rows).  The
        # Triton path keeps vLLM's model-dtype slots (its shrink is float32).
        lora_dtype = dtype if use_triton else torch.float32
        self.layer_loras = [LayerLoRA(layer, max_loras, max_rank, lora_dtype, device) for layer in model.layers]
        self.model_lora = ModelLoRA(model.config.vocab_size, model.config.hidden_size,
                                    max_loras, max_rank, lora_dtype, device)
        self.attach(model)
        self._slot_targets: dict[int, frozenset] = {}  # slot -> modules its adapter targets
        self.paths: dict[str, str] = {}  # registry: name -> path
        self.keys: dict[str, str] = {}  # name -> key of its registration
        self._sources: dict[str, tuple[str, str]] = {}  # key -> (name, path), unloaded ones included
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by key
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self._free_slots = list(range(max_loras))
        # Adapters a step still in flight reads (async scheduling; set by the LoRA component
        # per planned step): their slots are not given to another adapter.
        self.busy: frozenset = frozenset()
        self._pins: dict[str, int] = {}  # key -> unfinished requests using it (kept in host memory)
        self._ids = itertools.count(1)

    def attach(self, model) -> None:
        """Give ``model`` (the served one, or its rebuild after a sleep) the slots."""
        for layer, slots in zip(model.layers, self.layer_loras):
            layer.lora = slots
        model.lora = self.model_lora

    # --- registry ------------------------------------------------------------------
    def register(self, name: str, path: str, inplace: bool = False) -> None:
        """``inplace``: replace an adapter of that name (vLLM's load_inplace); its
        requests already running finish with the old weights."""
        if not name or not path:
            raise LoRAError("Both 'lora_name' and 'lora_path' must be provided.", type=_INVALID)
        if name in self.paths and not inplace:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                            f"in place, set 'load_inplace' to True.", type=_INVALID)
        adapter = self._read(name, path)
        key = f"{name}#{next(self._ids)}"
        self.paths[name], self.keys[name], self._sources[key] = path, key, (name, path)
        self._cache(key, adapter)

    def unregister(self, name: str) -> None:
        if not name:
            raise LoRAError("'lora_name' needs to be provided to unload a LoRA adapter.", type=_INVALID)
        if name not in self.paths:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", 404)
        # Its slot and host copy go by LRU once no running request needs them.
        del self.paths[name], self.keys[name]

    def key_of(self, name: str) -> str:
        key = self.keys.get(name)
        if key is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", 404)
        return key

    def names(self, keys) -> list[str]:
        """The adapter names of registration keys (an unloaded one keeps its name)."""
        return sorted({self._sources[k][0] for k in keys})

    @property
    def resident(self) -> list[str]:
        """Names of the registered adapters now in a device slot."""
        return [self._sources[k][0] for k in self._slot_of if self.keys.get(self._sources[k][0]) == k]

    def _read(self, name: str, path: str) -> LoRAAdapter:
        if not os.path.isdir(path):
            raise LoRAError(f"Loading lora {name} failed: No adapter found for {path}", 404)
        try:
            adapter = load_adapter(name, path, self.max_rank, len(self.layer_loras))
        except (OSError, ValueError) as e:
            raise LoRAError(str(e)) from None
        for (layer, module), (a, b) in adapter.weights.items():
            if layer == MODEL:
                shapes, where = self.model_lora.shapes(), module
            else:
                if module in _MLP_MODULES and self.layer_loras[layer].gate_up is None:
                    raise LoRAError(f"LoRA adapter at {path}: layer {layer} is a mixture-of-experts layer; "
                                    f"LoRA on expert MLPs ({module}) is not supported")
                shapes, where = self.layer_loras[layer].shapes(), f"layer {layer} {module}"
            if module not in shapes:  # e.g. Phi-3's fused qkv_proj on a model with q/k/v_proj
                raise LoRAError(f"LoRA adapter at {path}: this model has no {module} (its projections: "
                                f"{', '.join(shapes)}; an adapter of another base model?)")
            fan_in, fan_out = shapes[module]
            if a.shape[1] != fan_in or b.shape[0] != fan_out:
                raise LoRAError(f"LoRA adapter at {path}: {where} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                                f"this model needs A [r, {fan_in}] / B [{fan_out}, r] (an adapter of another "
                                f"base model?)")
        return adapter

    def acquire(self, key: str) -> None:
        """A request will run with ``key``: its tensors stay in host memory until release."""
        self._host_copy(key)
        self._pins[key] = self._pins.get(key, 0) + 1

    def release(self, key: str) -> None:
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
        else:
            self._pins.pop(key, None)
            self._trim()

    def _cache(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        self._trim(keep=key)

    def _trim(self, keep: Optional[str] = None) -> None:
        """Drop least recently used unpinned host copies beyond --max-cpu-loras (never
        ``keep``, the one just read)."""
        excess = len(self._host) - self.max_cpu_loras
        for key in [k for k in self._host if k not in self._pins and k != keep][:max(excess, 0)]:
            del self._host[key]

    def _host_copy(self, key: str) -> LoRAAdapter:
        adapter = self._host.get(key)
        if adapter is None:
            adapter = self._read(*self._sources[key])
            self._cache(key, adapter)
        self._host.move_to_end(key)
        return adapter

    # --- slots ---------------------------------------------------------------------
    def loadable_beside(self, keys: frozenset, busy: frozenset) -> bool:
        """Whether the adapters ``keys`` can all be made resident without evicting one of
        them or of ``busy`` (the adapters a step still in flight reads)."""
        missing = sum(1 for k in keys if k not in self._slot_of)
        if not missing:
            return True
        evictable = sum(1 for k in self._slot_of if k not in keys and k not in busy)
        return missing <= len(self._free_slots) + evictable

    def _slot(self, key: str, in_use: set[str]) -> int:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            # Never a slot this step or the step in flight reads (``busy``, async scheduling).
            victim = next((n for n in self._slot_of if n not in in_use and n not in self.busy), None)
            if victim is None:  # the scheduler's admission bound makes this unreachable
                raise RuntimeError(f"more than --max-loras {self.max_loras} adapters in one step")
            slot = self._slot_of.pop(victim)
        adapter = self._host_copy(key)
        for i, slots in enumerate(self.layer_loras):
            slots.write(slot, i, adapter)
        self.model_lora.write(slot, adapter)
        self._slot_of[key] = slot
        self._slot_targets[slot] = frozenset(adapter.target_modules)
        return slot

    def step_batch(self, seq_adapters: Sequence[Optional[str]], query_lens: np.ndarray) -> Optional[LoRABatch]:
        """The step's LoRABatch from each scheduled sequence's adapter key (None: base)."""
        names = {n for n in seq_adapters if n is not None}
        if not names:
            return None
        slots = {n: self._slot(n, names) for n in names}
        per_seq = np.fromiter((-1 if n is None else slots[n] for n in seq_adapters), dtype=np.int64,
                              count=len(seq_adapters))
        targets = frozenset().union(*(self._slot_targets[s] for s in slots.values()))
        return LoRABatch.build(np.repeat(per_seq, query_lens), self.device, self.use_triton, targets)
