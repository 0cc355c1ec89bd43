"""``POST /inference/v1/generate``, vLLM 0.32's token-in API: its HTTP shapes
(``protocol``, which the OpenAI shapes reuse for errors, logprobs and metrics), the
mapping of a request onto the wire (``request_mapping``, with ``unserved_fields``),
and its answers (``response_builder``: the non-stream body and the stream's chunks,
the relay's formatters; ``logprobs_format``, shared with the OpenAI routes).

The route itself is ``gateway.resources.generate``; the relay both APIs stream
through is ``gateway.relay``.
"""
