"""``POST /inference/v1/generate``: decode, validate, dispatch, relay as JSON or SSE
(gateway/relay.py, with /generate's formatters from gateway/generate_api/response_builder.py)."""
from __future__ import annotations

import time

import falcon

from common.errors import BadRequest, ServingError
from common.validation import validate_request
from gateway.body import decode_json, is_json, read_body
from gateway.generate_api.protocol import generate_request_decoder
from gateway.generate_api.request_mapping import check_encodable, cluster_for, map_request
from gateway.generate_api.response_builder import ResponseAccumulator, ResponseOptions, StreamChunker
from gateway.multimodal import attach_images
from gateway.openai_api import generate_derender
from gateway.relay import Generation, respond
from gateway.state import GatewayState


class GenerateResource:
    def __init__(self, state: GatewayState, renderer=None):
        self.state = state
        # The gateway's text side (gateway/openai_api/render.py; None without --tokenizer):
        # its reasoning / tool-call parsers parse output_mode "derender" output.
        self.renderer = renderer

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        arrival = time.time()
        s = self.state.settings
        if not is_json(req.content_type):
            raise ServingError("Unsupported Media Type: Only 'application/json' is allowed", status=400,
                               type="BadRequestError")
        body = await read_body(req, s.max_body_bytes)
        http = decode_json(generate_request_decoder, body)
        del body  # a big body need not outlive its decoding
        cluster = await cluster_for(self.state, http.model)
        so_policy = self.state.structured_outputs
        mapped = map_request(http, req.headers, cluster, cluster.model, served_model_names=s.served_model_names,
                             arrival_time=arrival, structured_outputs=so_policy)
        derender = None
        if mapped.derender:
            if s.tokens_only or not cluster.model.has_tokenizer:
                raise BadRequest("output_mode='derender' requires a tokenizer, but this server does not load one "
                                 "(--tokens-only or --skip-tokenizer-init). Send the request to a server that "
                                 "loads a tokenizer, or use output_mode='tokens'.", "output_mode")
            generate_derender.check(mapped.stream, mapped.parse_context, self.renderer)
        validate_request(mapped.wire, cluster.model, tokens_only=s.tokens_only, stream=mapped.stream)
        if so_policy is not None:  # the constraint must convert to a grammar: before admission
            await so_policy.check(mapped.wire.params.structured_outputs, self.state.render_pool)
        if mapped.derender:
            # Decodes the prompt (where generation starts inside reasoning): off the event loop.
            args = (mapped.parse_context, self.renderer, http.token_ids, cluster.model.max_model_len)
            pool = self.state.render_pool
            derender = await pool.run(generate_derender.setup, *args) if pool else generate_derender.setup(*args)
        await attach_images(mapped, self.state.image, s)  # after the cheap checks
        if s.tokens_only:
            mapped.wire.params.detokenize = False  # after validation, as vLLM's --tokens-only does
        check_encodable(mapped.wire)

        run = Generation(self.state, req, mapped, num_prompt_tokens=len(http.token_ids))
        details = ResponseOptions(prompt_tokens_details=s.enable_prompt_tokens_details,
                                  routed_experts=s.enable_return_routed_experts,
                                  sampling_mask=s.return_sampling_mask,
                                  spec_decode_metrics=s.per_request_spec_decode_metrics,
                                  timing_metrics=s.enable_per_request_metrics,
                                  token_id_placeholders=s.return_tokens_as_token_ids)
        formatter = StreamChunker(mapped, details) if mapped.stream else ResponseAccumulator(mapped, details, derender)
        await respond(resp, [run], formatter, mapped.stream)
