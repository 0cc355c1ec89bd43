"""The gateway under big texts and hostile request templates, on real processes
(a --render-only gateway over the tiny Qwen3 chat model, driven over HTTP):

- concurrent multi-MB ``/tokenize`` and over-long chat / completion renders: the gateway's
  peak RSS (sampled from /proc while they run) stays bounded, and a text that cannot fit
  ``max_model_len`` gets vLLM's 400 quickly (its ``_text_len_check`` bound: characters
  over max_model_len x the longest vocabulary string), before it is tokenized;
- ``wordwrap`` in a request template stops at its guard, and ``/health`` stays fast while
  eight such renders run;
- ``/detokenize`` takes the padding ids between the tokenizer's size and the model's
  vocab_size (Qwen's 151,665-151,935) as vLLM does.  SkyRL's ``RemoteInferenceClient``,
  which detokenizes sampled ids this way, does not install here (``skyrl`` pulls ray and a
  pinned torch): its request (``POST /detokenize {"tokens": [...]}``, reading ``prompt``) is
  sent with httpx;
- a derender body over --max-body-bytes gets its 413 rather than a connection reset.
"""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_openai_http import build_chat_model
from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup

pytestmark = pytest.mark.timeout(300)

NO_BROKER = "tcp://127.0.0.1:9"  # --render-only gateways never connect
MAX_MODEL_LEN = 4096
PADDED_VOCAB = 64  # ids the model's embedding has past the tokenizer's


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir) -> Path:
    """The tiny Qwen3 chat model with its config's vocab_size padded past the tokenizer's,
    as Qwen's checkpoints are."""
    out = build_chat_model(qwen3_dir, tmp_path_factory.mktemp("render-bounds") / "model")
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += PADDED_VOCAB
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("render-bounds-procs")) as group:
        yield group


@pytest.fixture(scope="module")
def gw(procs, chat_model):
    return start_gateway(procs, NO_BROKER, "--render-only", "--tokenizer", str(chat_model),
                         "--max-model-len", str(MAX_MODEL_LEN), "--trust-request-chat-template",
                         "--timeout-keep-alive", "1")


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == r.status_code
    return body["error"]


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class _PeakRss:
    """Samples a process's RSS in a thread until stopped; ``peak`` in kB."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_kb(self.pid))
            self._stop.wait(0.01)

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_big_texts_attack_keeps_rss_bounded_and_overlong_renders_fail_fast(gw):
    """Six concurrent 7 MB /tokenize calls (vLLM tokenizes them: /tokenize has no length
    limit) beside four 8 MB chat renders and four 8 MB completion renders that cannot fit
    max_model_len: the renders' 400s come at once, and the gateway's memory stays bounded."""
    for _ in range(3):  # warm: first-request imports and caches count as idle
        assert httpx.post(gw.url + "/tokenize", json={"prompt": "hello"}).status_code == 200
    idle = _rss_kb(gw.proc.pid)
    big_text = "hello world " * (7 * 1024 * 1024 // 12)
    chat = {"messages": [{"role": "user", "content": "x" * (8 * 1024 * 1024 - 200)}]}
    completion = {"prompt": "y" * (8 * 1024 * 1024 - 200)}

    def send(path: str, body: dict) -> tuple[str, httpx.Response, float]:
        t0 = time.monotonic()
        r = httpx.post(gw.url + path, json=body, timeout=240)
        return path, r, time.monotonic() - t0

    jobs = [("/tokenize", {"prompt": big_text})] * 6 + [("/v1/chat/completions/render", chat)] * 4 + \
           [("/v1/completions/render", completion)] * 4
    with _PeakRss(gw.proc.pid) as rss, concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: send(*job), jobs))
    refusals = []
    for path, r, elapsed in results:
        if path == "/tokenize":
            assert r.status_code == 200, r.text[:300]
            assert r.json()["count"] == len(big_text)  # the tiny byte-level vocabulary: a token a byte
        else:
            assert r.status_code == 400, r.text[:300]
            err = _error(r)
            assert err["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                                              "However, your prompt contains "), err
            assert err["param"] == "input_text" and err["type"] == "BadRequestError", err
            refusals.append(elapsed)
    print(f"idle RSS {idle // 1024} MiB, peak {rss.peak // 1024} MiB; refusals took {sorted(refusals)}")
    # Measured on a loaded 2-core box: 10 s at most for a refusal (mostly the 8 MB upload and
    # JSON decode, beside six tokenizations), peak 0.26 GB.  Before: 240+ s (timed out), 2+ GB.
    assert max(refusals) < 30, refusals
    assert rss.peak < 1024 * 1024, f"peak RSS {rss.peak // 1024} MiB (idle {idle // 1024} MiB)"


def test_detokenize_takes_the_models_padding_ids(gw, chat_model):
    """Ids from the tokenizer's size up to config.json's vocab_size decode to nothing, as
    vLLM's fast-tokenizer decode gives them; past the model's vocabulary is still a 400."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_model))
    vocab = json.loads((chat_model / "config.json").read_text())["vocab_size"]
    padding = [len(hf), vocab - 1]
    ids = [72, 101, *padding, 108]
    r = httpx.post(gw.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf.decode(ids)} == {"prompt": "Hel"}
    r = httpx.post(gw.url + "/detokenize", json={"tokens": [72, vocab]})
    assert r.status_code == 400 and _error(r)["message"] == f"Token id {vocab} is out of vocabulary", r.text


def test_an_oversized_derender_body_gets_its_413_not_a_reset(gw):
    """A ~50 MB body (over --max-body-bytes' 32 MiB; vLLM reads it and answers 400 on
    logprobs.content) from a client slower than the keep-alive timeout (1 s here): a 413
    sent at once, with the upload still running, left the connection to the keep-alive
    timer, which closed it under the client (a reset mid-upload).  The gateway now reads
    the body to the end, then answers.  The client paces its upload in 1 MB pieces: a slow
    link, not a wait for the server."""
    content = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}] * 700_000
    body = json.dumps({"model": None, "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                                                   "logprobs": {"content": content}, "finish_reason": "stop"}]})
    body = body.encode()
    assert len(body) > 45_000_000
    head = (f"POST /v1/chat/completions/derender HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        sock.sendall(head)
        step = 1 << 20
        for i in range(0, len(body), step):
            sock.sendall(body[i:i + step])  # a reset here: the server closed mid-upload
            time.sleep(0.05)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    status = answer.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "Request body exceeds the limit" in error["message"] and error["code"] == 413, error
    assert httpx.get(gw.url + "/health").status_code == 200


WORDWRAP_LOOP = ("{% for i in range(100000) %}{% set x = messages[0].content|wordwrap(1) %}{% endfor %}"
                 "{{ messages[0].content }}")


@pytest.mark.parametrize("template, needles, within", [
    # One 300k-character line, quadratic in textwrap (5+ s in one call, past every check):
    # refused by the guard at once.
    ("{{ messages[0].content|wordwrap(1) }}", ("wordwrap to wrap a line of 300000 characters",), 4),
    # Three million short lines in one call (15+ s, past every check before): a step each,
    # so the render stops at its step budget or its 5 s deadline.
    ("{{ ('a\\n' * 3000000)|wordwrap(5) }}", ("--chat-template-timeout", "steps"), 12),
])
def test_wordwrap_is_guarded(gw, template, needles, within):
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/chat/completions/render", timeout=60, json={
        "messages": [{"role": "user", "content": "a" * 300_000}], "chat_template": template})
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    assert any(n in _error(r)["message"] for n in needles), r.text[:300]
    assert elapsed < within, elapsed


def test_health_stays_fast_beside_eight_hostile_template_renders(gw):
    """Eight renders that each burn their whole 5 s render budget in wordwrap calls (each
    under the guard's line cap): /health, sampled all the while, answers quickly."""
    body = {"messages": [{"role": "user", "content": "a" * 16_000}], "chat_template": WORDWRAP_LOOP}
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        client.get("/health")  # connection made before the renders start
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            renders = [pool.submit(httpx.post, gw.url + "/v1/chat/completions/render", json=body, timeout=120)
                       for _ in range(8)]
            latencies = []
            while not all(f.done() for f in renders):
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - t0)
        for f in renders:
            r = f.result()
            assert r.status_code == 400 and "--chat-template-timeout" in _error(r)["message"], r.text[:300]
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    print(f"/health: {len(latencies)} samples, median {latencies[len(latencies) // 2] * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert len(latencies) > 50
    assert p99 < 0.1, p99
