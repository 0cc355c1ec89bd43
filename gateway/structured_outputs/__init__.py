"""Structured outputs at the gateway (vLLM 0.33's ``StructuredOutputsParams``).

- ``params``: a request's ``structured_outputs`` JSON -> the wire ``StructuredOutputs``, with
  vLLM's type and value checks (exactly one constraint, its messages) and our size bounds;
- ``grammar_check``: the constraint converted to an xgrammar grammar (vLLM's
  ``validate_xgrammar_grammar``) on the render pool, before admission, with a bounded cache;
- ``openai_mapping``: ``response_format`` / ``tool_choice`` / Responses ``text.format`` ->
  ``structured_outputs``, as vLLM's ``extract_structured_outputs`` and ``adjust_request``;
- ``tool_schema``: vLLM's ``get_json_schema_from_tools``;
- ``policy``: the server's ``--structured-outputs-config`` applied to each request (whitespace
  default, the reasoning markers after which the grammar starts).

The engine side (the token bitmask) lives in the workers.
"""
