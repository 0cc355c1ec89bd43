"""Image input against hostile media (issue 33), through real gateway processes over HTTP:

* image bombs (tiny files, huge decodes): refused from their headers before any pixel
  is decoded (placeholder counts, --max-image-decoded-pixels, --max-request-decoded-pixels),
  and the memory of large decodes given back afterwards;
* remote media (--allow-remote-media): every redirect hop re-checked (private addresses,
  schemes, --allowed-media-domains), one deadline for the whole fetch
  (--image-fetch-timeout), and slow servers never delaying unrelated requests.

The gateway's CPU time and RSS are read from /proc (Linux only)."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("transformers")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from common.multimodal import Qwen2VLImageConfig, grid_thw_for_size, num_placeholder_tokens  # noqa: E402
from tests.support.gateway_helpers import GENERATE, start_gateway  # noqa: E402
from tests.support.procs import ProcGroup, wait_for, wait_for_workers  # noqa: E402
from tests.integration.test_mm_chat import _write_tokenizer  # noqa: E402
from tests.integration.test_mm_http import PREPROCESSOR  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

IMAGE, VSTART, VEND = 150, 151, 152  # the chat tokenizer's ids (tests/integration/test_mm_chat.py)
CFG = Qwen2VLImageConfig.from_dict(PREPROCESSOR)
BOMB_SIDE = 13000  # 169 M pixels: ~490 KB of PNG, ~510 MB decoded


# ----------------------------------------------------------------------------- images
@functools.lru_cache(maxsize=None)
def _flat_png(width: int, height: int) -> bytes:
    """A black RGB PNG written row by row (never held decoded here): the zeros compress
    about 1000:1, so a file of a few hundred KB decodes to width*height*3 bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    row = bytes(1 + 3 * width)  # filter byte 0, then the row's pixels
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _small_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _tokens(width: int, height: int) -> int:
    return num_placeholder_tokens(grid_thw_for_size(height, width, CFG), CFG.merge_size)


def _prompt(counts: list[int]) -> list[int]:
    ids = [5, 17, 33]
    for k, n in enumerate(counts):
        ids += [40 + k, VSTART] + [IMAGE] * n + [VEND]
    return ids + [61, 62]


def _generate(ids, urls) -> dict:
    return {"token_ids": ids, "content_parts": [{"type": "image_url", "url": u} for u in urls],
            "sampling_params": {"max_tokens": 2}}


def _chat(*urls, text="what is it?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]}


def _error(resp, status=400) -> str:
    assert resp.status_code == status, resp.text[:500]
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == status, body
    return body["error"]["message"]


# ----------------------------------------------------------------------------- /proc
def _cpu_s(pid: int) -> float:
    """utime + stime of the whole process (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# ----------------------------------------------------------------------------- stacks
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """What the gateway reads of a Qwen2-VL folder: config (image token, vision merge),
    preprocessor (small max_pixels: any bomb resizes to 112x112, 16 placeholders), a
    tokenizer with the Qwen2-VL chat template.  No weights: the gateway never loads them."""
    return _model_files(tmp_path_factory.mktemp("qwen2_vl_files"), PREPROCESSOR)


def _model_files(out, preprocessor: dict):
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen2_vl", "image_token_id": IMAGE, "vision_start_token_id": VSTART,
        "vision_end_token_id": VEND, "vision_config": {"spatial_merge_size": 2}, "max_position_embeddings": 4096}))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    _write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("sec-media")) as group:
        yield group


@pytest.fixture(scope="module")
def broker(procs):
    """A broker with a fake worker: /inference/v1/generate maps requests against it; the
    refusals tested here never reach it."""
    broker = procs.broker()
    procs.fake_worker(broker, 0)
    wait_for_workers(broker.frontend, 1)
    return broker


def _render_gateway(procs, model_dir, *extra):
    """A render-only gateway (/tokenize and /v1/chat/completions/render load images; no broker)."""
    return start_gateway(procs, "tcp://127.0.0.1:1", "--render-only", "--tokenizer", str(model_dir), *extra)


# ----------------------------------------------------------------------------- bombs
def test_placeholder_mismatch_refused_before_any_decode(procs, broker, model_dir):
    """20 bombs (13000x13000, ~490 KB each) whose placeholder runs do not match: a 400
    from the headers alone.  Decoding them all first (as before) cost ~30 s of gateway CPU."""
    gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir),
                       "--max-image-decoded-pixels", str(200_000_000),
                       "--max-request-decoded-pixels", str(10 ** 12))
    bomb = _data_url(_flat_png(BOMB_SIDE, BOMB_SIDE))
    need = _tokens(BOMB_SIDE, BOMB_SIDE)
    body = json.dumps(_generate(_prompt([need] * 19 + [need + 1]), [bomb] * 20))
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        before = _cpu_s(gw.proc.pid)
        resp = http.post(GENERATE, content=body, headers={"content-type": "application/json"})
        used = _cpu_s(gw.proc.pid) - before
        msg = _error(resp)
        assert f"placeholder count mismatch: image 19 has {need + 1} placeholder tokens" in msg, msg
        # reading the body and 20 headers; one decode alone is ~0.7 s
        assert used < 0.5, f"the gateway used {used:.2f} s of CPU on a refusal"

        # the same request with the runs right is served (the bound allows these bombs)
        ok = http.post(GENERATE, json=_generate(_prompt([need]), [bomb]))
        assert ok.status_code == 200, ok.text[:500]


def test_decoded_pixel_bounds(procs, broker, model_dir):
    """Over --max-image-decoded-pixels (one image) or --max-request-decoded-pixels (all of
    a request's): 400 naming the flag, before decoding; the defaults refuse a 13000x13000."""
    gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir),
                       "--max-image-decoded-pixels", "1000000", "--max-request-decoded-pixels", "1500000")
    at_bound, over = _flat_png(1000, 1000), _flat_png(1001, 1000)
    n = _tokens(1000, 1000)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        msg = _error(http.post(GENERATE, json=_generate(_prompt([n]), [_data_url(over)])))
        assert "1001x1000 (1001000 pixels)" in msg and "--max-image-decoded-pixels" in msg, msg
        msg = _error(http.post(GENERATE, json=_generate(_prompt([n, n]), [_data_url(at_bound)] * 2)))
        assert "2000000 pixels in all" in msg and "--max-request-decoded-pixels" in msg, msg
        msg = _error(http.post("/tokenize", json=_chat(_data_url(at_bound), _data_url(at_bound))))
        assert "--max-request-decoded-pixels" in msg, msg
        ok = http.post(GENERATE, json=_generate(_prompt([n]), [_data_url(at_bound)]))
        assert ok.status_code == 200, ok.text

    default = _render_gateway(procs, model_dir)
    with httpx.Client(base_url=default.url, timeout=60) as http:
        msg = _error(http.post("/tokenize", json=_chat(_data_url(_flat_png(BOMB_SIDE, BOMB_SIDE)))))
        assert "more than the 50000000 pixels one image may decode to (--max-image-decoded-pixels)" in msg, msg


def test_concurrent_bombs_give_memory_back(procs, broker, tmp_path_factory):
    """Three concurrent 7000x7000 images (just under the default bound, ~200 MB decoded
    each) on /generate, with a processor of realistic size (the resized images are MBs,
    as are their wire bytes): the gateway's RSS comes back to within 20 % of its idle
    level afterwards (before: +80 %, the buffers kept by glibc's heap)."""
    preprocessor = dict(PREPROCESSOR, max_pixels=28 * 28 * 3600)  # up to 3600 placeholders
    folder = _model_files(tmp_path_factory.mktemp("qwen2_vl_big"), preprocessor)
    cfg = Qwen2VLImageConfig.from_dict(preprocessor)
    need = num_placeholder_tokens(grid_thw_for_size(7000, 7000, cfg), cfg.merge_size)
    gw = start_gateway(procs, broker.frontend, "--tokenizer", str(folder))
    pid = gw.proc.pid
    big = _data_url(_flat_png(7000, 7000))
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        # warm: Pillow, the pools and the threads exist before "idle" is read
        warm = http.post(GENERATE, json=_generate(_prompt([4]), [_data_url(_small_png())]))
        assert warm.status_code == 200, warm.text
        idle = _rss_mb(pid)

        def one(_):
            return http.post(GENERATE, json=_generate(_prompt([need]), [big]))

        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, range(3)))
        for r in results:
            assert r.status_code == 200, r.text[:300]
            assert r.json()["usage"]["prompt_tokens"] > need
        try:
            wait_for(lambda: _rss_mb(pid) <= idle * 1.2, 20, "the gateway's RSS back near idle", interval=0.2)
        except TimeoutError:
            raise AssertionError(f"RSS {_rss_mb(pid):.0f} MB, idle {idle:.0f} MB") from None


def test_decode_pool_is_bounded(procs, model_dir, tmp_path):
    """One decode thread, no queue: while an image is being read and decoded, another image
    request gets a 503 at once (naming the flags) instead of waiting unbounded; requests
    without images are not in that pool at all.  The busy image is a FIFO under
    --allowed-local-media-path: the gateway's decode thread blocks reading it until the
    test writes, and the test's open() returns only once the gateway has opened it."""
    media = tmp_path / "media"
    media.mkdir()
    fifo = media / "slow.png"
    os.mkfifo(fifo)
    gw = _render_gateway(procs, model_dir, "--allowed-local-media-path", str(media),
                         "--image-decode-threads", "1", "--image-decode-queue", "0")
    small = _data_url(_small_png())
    with httpx.Client(base_url=gw.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(http.post, "/tokenize", json=_chat(fifo.as_uri()))
        with open(fifo, "wb") as writer:  # returns once the decode thread opened the FIFO
            msg = _error(http.post("/tokenize", json=_chat(small)), 503)
            assert "--image-decode-threads" in msg and "--image-decode-queue" in msg, msg
            assert http.get("/health").status_code == 200
            assert http.post("/tokenize", json={"prompt": "no image"}).status_code == 200
            writer.write(_small_png())
        first = busy.result()
        assert first.status_code == 200, first.text
        again = http.post("/tokenize", json=_chat(small))
        assert again.status_code == 200 and again.json()["tokens"] == first.json()["tokens"], again.text


# ----------------------------------------------------------------------------- remote
class _Media(http.server.BaseHTTPRequestHandler):
    """/img.png; /to?url=X: 302 to X; /slow: an image body at one byte a second."""

    protocol_version = "HTTP/1.1"
    png = b""
    slow_active = 0
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802
        parts = urlsplit(self.path)
        if parts.path == "/img.png":
            self._send(200, self.png, "image/png")
        elif parts.path == "/to":
            self.send_response(302)
            self.send_header("Location", parse_qs(parts.query)["url"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif parts.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif parts.path == "/host":  # the image only for the right Host header
            if self.headers.get("Host") == self.server.expect_host:
                self._send(200, self.png, "image/png")
            else:
                self._send(421, b"wrong host", "text/plain")
        elif parts.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            with _Media.lock:
                _Media.slow_active += 1
            try:
                for b in self.png:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass  # the gateway gave up: expected
            finally:
                with _Media.lock:
                    _Media.slow_active -= 1
        else:
            self._send(404, b"no", "text/plain")

    def _send(self, status, body, ctype):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_servers():
    """The same media server on 127.0.0.1 and on 127.0.0.2 (both loopback): the gateways
    below opt only 127.0.0.2 in, so 127.0.0.1 stands for an internal address."""
    _Media.png = _small_png()
    servers = []
    for host in ("127.0.0.1", "127.0.0.2"):
        srv = http.server.ThreadingHTTPServer((host, 0), _Media)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield tuple(f"http://{s.server_address[0]}:{s.server_address[1]}" for s in servers)
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_redirects_are_checked_at_every_hop(procs, model_dir, media_servers):
    internal, public = media_servers  # 127.0.0.1: refused; 127.0.0.2: opted in
    gw = _render_gateway(procs, model_dir, "--allow-remote-media", "--allow-media-private-networks", "127.0.0.2/32")
    port = public.rsplit(":", 1)[1]
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        def tokenize(url):
            return http.post("/tokenize", json=_chat(url))

        ok = tokenize(f"{public}/img.png")
        assert ok.status_code == 200, ok.text
        assert tokenize(f"{public}/to?url={public}/img.png").json()["tokens"] == ok.json()["tokens"]

        assert "resolves to a blocked address: 127.0.0.1" in _error(tokenize(f"{internal}/img.png"))
        msg = _error(tokenize(f"{public}/to?url={internal}/img.png"))  # a redirect into the private network
        assert "resolves to a blocked address: 127.0.0.1" in msg, msg
        msg = _error(tokenize(f"{public}/to?url=file:///etc/hostname"))
        assert "file: URLs are not fetched (only http and https, redirects included)" in msg, msg
        msg = _error(tokenize(f"{public}/to?url=http://[::1]:{port}/img.png"))
        assert "blocked address: ::1" in msg, msg
        msg = _error(tokenize(f"{public}/to?url=http://0x7f000001:{port}/img.png"))  # 127.0.0.1 spelled in hex
        assert "blocked address: 127.0.0.1" in msg, msg
        assert "more than 5 redirects" in _error(tokenize(f"{public}/loop"))

    # vLLM's --allowed-media-domains: exact host names, on the first URL and every hop
    listed = _render_gateway(procs, model_dir, "--allow-remote-media", "--allow-media-private-networks",
                             "127.0.0.0/8", "--allowed-media-domains", "127.0.0.2")
    with httpx.Client(base_url=listed.url, timeout=60) as http:
        assert http.post("/tokenize", json=_chat(f"{public}/img.png")).status_code == 200
        msg = _error(http.post("/tokenize", json=_chat(f"http://localhost:{port}/img.png")))
        assert msg.endswith("allowed domains: ['127.0.0.2']. Input URL domain: localhost"), msg
        msg = _error(http.post("/tokenize", json=_chat(f"{public}/to?url=http://localhost:{port}/img.png")))
        assert "Input URL domain: localhost" in msg, msg


def test_fetch_connects_to_the_address_it_checked(monkeypatch):
    """DNS rebinding: the host is resolved once per hop and the connection goes to the
    address the policy checked (with the URL's Host header), never to a second answer.
    In-process (no DNS to rebind otherwise): a resolver answering the allowed 127.0.0.2
    first and the refused 127.0.0.1 after, two servers on one port of each."""
    import socket

    from common.multimodal import FetchPolicy, parse_networks
    from common.multimodal.media import fetch_http

    allowed = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Media)
    port = allowed.server_address[1]
    try:
        internal = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Media)
    except OSError:
        allowed.server_close()
        pytest.skip(f"port {port} is taken on 127.0.0.1")
    _Media.png = _small_png()
    for srv in (allowed, internal):
        srv.expect_host = f"images.example:{port}"
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    internal.RequestHandlerClass = type("Internal", (_Media,), {"png": b"internal secret"})
    answers = []
    real = socket.getaddrinfo

    def resolver(host, *args, **kwargs):
        if host == "images.example":
            answers.append(host)
            host = "127.0.0.2" if len(answers) == 1 else "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    policy = FetchPolicy(allow_remote=True, private_networks=parse_networks(["127.0.0.2/32"]), timeout_s=5)
    try:
        data = fetch_http(f"http://images.example:{port}/host", policy, 1 << 20, time.monotonic() + 5)
        assert data == _Media.png and answers == ["images.example"]
    finally:
        for srv in (allowed, internal):
            srv.shutdown()
            srv.server_close()


def test_slow_server_meets_the_deadline_and_delays_nothing_else(procs, model_dir, media_servers):
    """A server sending one byte a second: the fetch fails at --image-fetch-timeout (2 s
    here) however many bytes trickle in, and while eight such fetches hang, /health, a text
    /tokenize and an inline-image /tokenize answer at once."""
    _, public = media_servers
    timeout = 2.0
    gw = _render_gateway(procs, model_dir, "--allow-remote-media", "--allow-media-private-networks", "127.0.0.2/32",
                         "--image-fetch-timeout", str(timeout))
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        assert http.post("/tokenize", json=_chat(_data_url(_small_png()))).status_code == 200  # warm

        def slow(_):
            start = time.monotonic()
            resp = http.post("/tokenize", json=_chat(f"{public}/slow"))
            return resp, time.monotonic() - start

        with ThreadPoolExecutor(8) as pool:
            hanging = [pool.submit(slow, k) for k in range(8)]
            wait_for(lambda: _Media.slow_active == 8, 10, "eight slow fetches in flight")
            for method, path, body in (("GET", "/health", None),
                                       ("POST", "/tokenize", {"prompt": "hello there"}),
                                       ("POST", "/tokenize", _chat(_data_url(_small_png())))):
                start = time.monotonic()
                resp = http.request(method, path, json=body)
                took = time.monotonic() - start
                assert resp.status_code == 200, resp.text
                assert took < 0.5 and _Media.slow_active > 0, f"{path} took {took:.2f} s behind slow fetches"
            for fut in hanging:
                resp, took = fut.result()
                msg = _error(resp)
                assert f"timed out after {timeout:g} s" in msg, msg
                assert took < timeout + 1.5, f"a slow fetch answered after {took:.1f} s"
