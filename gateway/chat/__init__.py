"""Chat-template rendering for the gateway, split by concern.

The public entry point is ``gateway.chat.template``; these modules hold its parts:
``jinja_env`` (the Jinja sandbox transformers renders with), ``messages`` (vLLM's
text-only message preprocessing), ``inputs`` (tools, documents and
chat_template_kwargs as vLLM merges them), ``loading`` (where a model's template and
special tokens come from) and ``errors``.
"""
