"""--api-key against path tricks: every route the gateway registers, spelled every way
the router still serves it, is 401 without the key (issue: `//pause` was served
keyless because the check read the raw path while Falcon's router ignores empty
segments).

The route list comes from the app itself (built in-process with the same flags), so a
route added later is covered without touching this test; the requests go over a real
socket to a real gateway process, sent with http.client so no client library
normalises the path on the way.
"""
from __future__ import annotations

import http.client
import json
from urllib.parse import quote

import pytest

from gateway.auth import ANTHROPIC_UNAUTHORIZED_BODY, OPEN_ROUTES, X_API_KEY_ROUTES
from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

KEY, KEY2 = "sk-first-key", "sk-second-key"


def _flags(model_dir) -> list[str]:
    return ["--api-key", KEY, KEY2, "--enable-rl", "--allow-runtime-lora", "--tokenizer", str(model_dir),
            "--enable-tokenizer-info-endpoint"]


def _templates(node_list) -> list[str]:
    out = []
    for node in node_list:
        if node.resource is not None:
            out.append(node.uri_template)
        out.extend(_templates(node.children))
    return out


def registered_routes(flags: list[str]) -> list[str]:
    """Every URI template the gateway built from ``flags`` serves."""
    from gateway.app import create_falcon_app
    from gateway.main import build_parser, settings_from_args

    app, _ = create_falcon_app(settings_from_args(build_parser().parse_args(flags)), client=object())
    return sorted(set(_templates(app._router._roots)))


def variants(route: str) -> dict[str, bool]:
    """Spellings of ``route`` -> whether Falcon's router serves them (else 404 is also fine)."""
    head, _, rest = route.lstrip("/").partition("/")
    pct = "/" + "".join(f"%{ord(c):02X}" if i == 0 else c for i, c in enumerate(head)) + ("/" + rest if rest else "")
    return {
        route: True,
        "/" + route: True,  # //pause
        "//" + route: True,  # ///pause
        route + "/": True,  # trailing slash (stripped by the app's option)
        pct: True,  # /%70ause
        "/." + route: False,  # /./pause: not resolved by the router, must still not be served
        "/x/.." + route: False,
        route.upper(): False,
        quote(route.upper(), safe="/"): False,
    }


def _request(port: int, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body if body is not None else (b"{}" if method == "POST" else None),
                     headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def locked_gateway(tmp_path_factory, demo_model_dir):
    with ProcGroup(tmp_path_factory.mktemp("auth")) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0)
        wait_for_workers(broker.frontend, 1)
        gw = start_gateway(procs, broker.frontend, *_flags(demo_model_dir))
        yield gw


def test_route_list_covers_the_dangerous_routes(demo_model_dir):
    routes = registered_routes(_flags(demo_model_dir))
    for must in ("/pause", "/inference/v1/generate", "/v1/chat/completions", "/v1/load_lora_adapter",
                 "/weight_info", "/v1/models", "/tokenize", "/update_weights", "/weight_checker",
                 "/collective_rpc", "/server_info", "/kv_event_sources", "/get_server_info", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}"):
        assert must in routes, routes


def test_every_route_and_spelling_needs_the_key(locked_gateway, demo_model_dir):
    port = locked_gateway.port
    served_without_key = []
    for route in registered_routes(_flags(demo_model_dir)):
        if route in OPEN_ROUTES:
            continue
        for path, routed in variants(route).items():
            for method in ("GET", "POST"):
                status, body = _request(port, method, path)
                allowed = (401,) if routed else (401, 404)
                if status not in allowed:
                    served_without_key.append((method, path, status, body[:80]))
                elif status == 401:
                    # The Anthropic routes answer in Anthropic's error shape.
                    want = json.loads(ANTHROPIC_UNAUTHORIZED_BODY) if routed and route in X_API_KEY_ROUTES \
                        else {"error": "Unauthorized"}
                    assert json.loads(body) == want
    assert not served_without_key, served_without_key


def test_bypass_attempts_change_no_state(locked_gateway):
    port = locked_gateway.port
    for path in ("//pause", "///pause", "/%70ause", "//pause?mode=abort"):
        assert _request(port, "POST", path)[0] == 401
    status, body = _request(port, "GET", "/is_paused", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body) == {"is_paused": False}


@pytest.mark.parametrize("header,ok", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER {KEY}", True), (f"Bearer {KEY2}", True),
    (f"Bearer {KEY}x", False), (f"Bearer  {KEY}", False), (f"Basic {KEY}", False), (KEY, False),
    ("Bearer", False), ("", False), (f"Bearer {KEY} {KEY2}", False),
])
def test_bearer_scheme_is_case_insensitive_and_any_key_works(locked_gateway, header, ok):
    status, _ = _request(locked_gateway.port, "GET", "//v1/models", {"Authorization": header} if header else {})
    assert (status == 200) is ok, status


def test_probes_stay_open(locked_gateway):
    for path in ("/health", "//health", "/metrics", "/version"):
        assert _request(locked_gateway.port, "GET", path)[0] == 200, path


def test_options_without_cors_is_a_method_like_any_other(locked_gateway, demo_model_dir):
    """No --allowed-origins: OPTIONS needs the key where GET/POST do (401), and with it (or
    on a probe) is a 405 in vLLM's error shape.  Falcon's default responder answered a
    keyless 200 on every route, preflight or not."""
    port = locked_gateway.port
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    wrong = []
    for route in registered_routes(_flags(demo_model_dir)):
        for headers in ({}, preflight):
            status, body = _request(port, "OPTIONS", route, headers)
            if status != (405 if route in OPEN_ROUTES else 401):
                wrong.append((route, headers, status, body[:80]))
        status, body = _request(port, "OPTIONS", route, {"Authorization": f"Bearer {KEY}"})
        error = json.loads(body).get("error") if status == 405 else None
        if not (isinstance(error, dict) and error.get("code") == 405 and error.get("type") == "MethodNotAllowedError"):
            wrong.append((route, "with key", status, body[:80]))
    assert not wrong, wrong


ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def cors_gateway(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("cors")) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0)
        wait_for_workers(broker.frontend, 1)
        yield start_gateway(procs, broker.frontend, "--api-key", KEY, "--allowed-origins", json.dumps([ORIGIN]),
                            "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]')


def test_cors_preflights_are_answered_only_as_configured(cors_gateway):
    port = cors_gateway.port

    def preflight(origin, method="POST", headers="authorization, content-type"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("OPTIONS", "/inference/v1/generate", headers={
            "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})
        r = conn.getresponse()
        answer = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        conn.close()
        return answer

    status, headers, _ = preflight(ORIGIN)  # no key: browsers send none on a preflight
    assert status == 200, headers
    assert headers["access-control-allow-origin"] == ORIGIN and "origin" in headers["vary"].lower()
    assert headers["access-control-allow-methods"] == "GET, POST"
    # An explicit list: the CORS-safelisted headers and the configured ones (Starlette's answer).
    assert headers["access-control-allow-headers"] == (
        "accept, accept-language, authorization, content-language, content-type")
    assert "access-control-allow-credentials" not in headers
    status, headers, body = preflight("https://evil.example")
    assert status == 400 and "access-control-allow-origin" not in headers and body == b"Disallowed CORS origin"
    assert preflight(ORIGIN, method="DELETE")[::2] == (400, b"Disallowed CORS method")
    assert preflight(ORIGIN, headers="x-custom")[::2] == (400, b"Disallowed CORS headers")
    # Not a preflight: the key, then 405.
    assert _request(port, "OPTIONS", "/inference/v1/generate")[0] == 401
    assert _request(port, "OPTIONS", "/health")[0] == 405
    # The actual request from the allowed origin carries the header; others do not.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("access-control-allow-origin") == ORIGIN
    r.read()
    conn.request("GET", "/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("access-control-allow-origin") is None
    conn.close()
