"""Stored ``/v1/responses`` (``store: true`` on a gateway run with
``VLLM_ENABLE_RESPONSES_API_STORE=1``, vLLM's switch; off by default as there).

vLLM keeps every stored response and its input messages in a dict that never shrinks
(its own warning says so).  Here the store is bounded and key-scoped:

- at most ``max_entries`` responses and ``max_bytes`` of them (a response's JSON plus its
  input messages' JSON); over either bound the oldest are evicted first, and one bigger
  than ``max_bytes`` alone is not stored.  Eviction and a gateway restart are the only
  ways one is lost (it lives in this process's memory);
- each entry belongs to the scope of the key that created it (gateway/auth.py
  ``key_scope``): a lookup with another key finds nothing (404, the same answer as an
  id that never existed, so ids cannot be probed across keys).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    messages: list  # the chat messages the response answered (vLLM's msg_store)
    size: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # formatters call put from the event loop; cheap either way

    def put(self, scope: str, response: dict, messages: list) -> bool:
        """Keep ``response`` for ``scope``; False when it alone is over the byte bound."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_bytes or self.max_entries < 1:
            return False
        key = (scope, response["id"])
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[key] = StoredResponse(response, messages, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size
        return True

    def get(self, scope: str, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            return self._entries.get((scope, response_id))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
