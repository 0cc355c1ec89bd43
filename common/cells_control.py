"""`tokserve cells`: one RL control operation fanned out to every cell, answers aggregated.

A *cell* is one broker with its workers and gateways; a deployment past one broker runs
several behind an L7 router (vllm-router).  The router spreads generation, but a trainer's
control operations (pause, resume, weight updates, LoRA loads) must reach *every* cell:
this command sends the operation to one gateway per cell (its RL routes, ``--enable-rl``
/ ``--allow-runtime-lora``), concurrently, and prints one line per cell and a verdict.
Exit status 0 only when every cell succeeded.

    tokserve cells pause --mode keep --cell http://cell-a:8000 --cell http://cell-b:8000
    tokserve cells update-weights --path /ckpt/step-100 --version step-100 --cells-file cells.txt
    tokserve cells load-lora --name sql --path /adapters/sql --cells-file cells.txt

Across cells there is no shared transaction, so each operation states what a partial
failure leaves behind:

- ``pause``: a cell that fails makes the command resume the cells that did pause (as the
  broker does across ranks): all or nothing.
- ``update-weights`` runs in phases, each on every cell before the next: start, load the
  checkpoint (staged, not served), finish (commit).  A failure before finish commits
  nothing anywhere (a later start drops what was staged): rerun the command.  A failure
  during finish, when some cells committed, leaves the cells on different weights: the
  report names them; rerun with ``--cell`` for those cells only (same path and version).
- ``resume``, ``load-lora``, ``unload-lora``, ``is-paused``: independent per cell; rerun
  for the failed cells.

Trust: the cell URLs and the API key come from the operator's command line (or
``$TOKSERVE_API_KEY`` / ``$VLLM_API_KEY``), never from a client; the key goes to every
listed cell, so list only your own (https beyond a private network).  It goes nowhere
else: redirects are never followed (a redirect would carry the key to another address,
and turn a POST into a GET that "succeeds" without pausing anything), and a cell counts
as done only when it gives the operation's own answer (200 and the body the gateway's
route returns); a 3xx, another 2xx or an unexpected body is that cell's failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class CellResult:
    cell: str
    ok: bool
    status: int  # HTTP status; 0: no answer (connection refused, timeout)
    body: Any  # the gateway's JSON answer, or the error text
    error: str = ""  # why a 200 or a redirect does not count as success


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow: urllib then raises HTTPError for the 3xx itself."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


# What each route answers on success (gateway/resources/rl.py, lora.py): anything else,
# though a 200, is a failure (e.g. a proxy's or another server's page).
def _status_is(value: str) -> Callable[[Any], bool]:
    return lambda body: isinstance(body, dict) and body.get("status") == value


def _has_message(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("message"), str)


def _is_paused_answer(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("is_paused"), bool)


def _lora_success(body: Any) -> bool:
    return isinstance(body, str) and body.startswith("Success")


class Cells:
    def __init__(self, urls: list[str], api_key: Optional[str] = None, timeout: float = 600.0):
        if not urls:
            raise ValueError("no cells: pass --cell URL (repeatable) or --cells-file")
        for url in urls:
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise ValueError(f"cell URL must be http(s)://HOST:PORT, got {url!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.timeout = timeout

    def call(self, url: str, method: str, path: str, body: Optional[dict] = None,
             expect: Callable[[Any], bool] = _has_message) -> CellResult:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
        try:
            with _opener.open(req, timeout=self.timeout) as resp:
                status, answer = resp.status, _json(resp.read())
        except urllib.error.HTTPError as exc:
            answer = _json(exc.read())
            if 300 <= exc.code < 400:
                return CellResult(url, False, exc.code, answer, f"redirected to {exc.headers.get('Location')!r}: not "
                                                                f"followed (the API key goes to the listed cell only)")
            return CellResult(url, False, exc.code, answer)
        except (urllib.error.URLError, OSError) as exc:
            return CellResult(url, False, 0, f"no answer: {getattr(exc, 'reason', exc)}")
        if status != 200:
            return CellResult(url, False, status, answer, f"HTTP {status}, not the route's 200")
        if not expect(answer):
            return CellResult(url, False, status, answer, f"not the answer of {path.split('?')[0]}")
        return CellResult(url, True, status, answer)

    def fan_out(self, method: str, path: str, body: Optional[dict] = None,
                urls: Optional[list[str]] = None, expect: Callable[[Any], bool] = _has_message) -> list[CellResult]:
        """The same call on every cell at once; results in the cells' order."""
        urls = self.urls if urls is None else urls
        with ThreadPoolExecutor(max_workers=min(32, len(urls))) as pool:
            return list(pool.map(lambda u: self.call(u, method, path, body, expect), urls))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


@dataclass
class Outcome:
    ok: bool
    results: list[CellResult]  # the last phase each cell went through
    note: str = ""  # what a partial failure left behind and how to retry


def pause(cells: Cells, mode: str = "abort", clear_cache: bool = True) -> Outcome:
    query = urllib.parse.urlencode({"mode": mode, "clear_cache": str(clear_cache).lower()})
    results = cells.fan_out("POST", f"/pause?{query}", expect=_status_is("paused"))
    if all(r.ok for r in results):
        return Outcome(True, results)
    paused = [r.cell for r in results if r.ok]
    undone = cells.fan_out("POST", "/resume", urls=paused, expect=_status_is("resumed")) if paused else []
    stuck = [r.cell for r in undone if not r.ok]
    note = (f"pause failed on {len(results) - len(paused)} cell(s): resumed the {len(paused)} that had paused"
            + (f"; resume FAILED on {', '.join(stuck)}: run `tokserve cells resume` for them" if stuck else
               "; no cell is left paused"))
    return Outcome(False, results, note)


def resume(cells: Cells) -> Outcome:
    return _independent(cells.fan_out("POST", "/resume", expect=_status_is("resumed")), "resume")


def is_paused(cells: Cells) -> Outcome:
    return _independent(cells.fan_out("GET", "/is_paused", expect=_is_paused_answer), "is-paused")


def load_lora(cells: Cells, name: str, path: str) -> Outcome:
    return _independent(cells.fan_out("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                      expect=_lora_success), "load-lora")


def unload_lora(cells: Cells, name: str) -> Outcome:
    return _independent(cells.fan_out("POST", "/v1/unload_lora_adapter", {"lora_name": name}, expect=_lora_success),
                        "unload-lora")


def _independent(results: list[CellResult], op: str) -> Outcome:
    failed = [r.cell for r in results if not r.ok]
    note = f"rerun `tokserve cells {op}` with --cell for: {' '.join(failed)}" if failed else ""
    return Outcome(not failed, results, note)


def update_weights(cells: Cells, path: str, version: str) -> Outcome:
    """Checkpoint folder -> every cell, staged everywhere before any cell commits."""
    phases: list[tuple[str, Optional[dict]]] = [
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {"path": path}}),
    ]
    for route, body in phases:
        results = cells.fan_out("POST", route, body)
        if not all(r.ok for r in results):
            return Outcome(False, results, f"{route} failed: nothing was committed on any cell (the next "
                                           f"start drops what was staged); rerun the command")
    results = cells.fan_out("POST", "/finish_weight_update", {"weight_version": version})
    committed = [r.cell for r in results if r.ok]
    if len(committed) == len(results):
        return Outcome(True, results)
    failed = [r.cell for r in results if not r.ok]
    if not committed:
        return Outcome(False, results, "/finish_weight_update failed everywhere: nothing was committed; "
                                       "rerun the command")
    return Outcome(False, results, f"PARTIAL: {len(committed)} cell(s) serve {version!r}, {len(failed)} do not; "
                                   f"rerun `tokserve cells update-weights --path {path} --version {version}` "
                                   f"with --cell for: {' '.join(failed)}")


# ------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokserve cells", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cell", action="append", default=[], metavar="URL",
                        help="a cell's gateway, e.g. http://10.0.0.5:8000 (repeatable)")
    common.add_argument("--cells-file", default=None, help="a file with one cell URL per line (# comments)")
    common.add_argument("--api-key", default=None, help="default: $TOKSERVE_API_KEY, else $VLLM_API_KEY")
    common.add_argument("--timeout", type=float, default=600.0, help="seconds per call to one cell")
    sub = p.add_subparsers(dest="op", required=True)
    pa = sub.add_parser("pause", parents=[common], help="pause every cell (all or nothing)")
    pa.add_argument("--mode", default="abort", choices=["abort", "wait", "keep"])
    pa.add_argument("--keep-cache", action="store_true", help="clear_cache=false")
    sub.add_parser("resume", parents=[common], help="resume every cell")
    sub.add_parser("is-paused", parents=[common], help="each cell's /is_paused")
    uw = sub.add_parser("update-weights", parents=[common],
                        help="load a checkpoint folder on every cell: staged everywhere, then committed")
    uw.add_argument("--path", required=True, help="safetensors checkpoint folder, as the workers see it")
    uw.add_argument("--version", required=True, help="the new weight version label")
    ll = sub.add_parser("load-lora", parents=[common], help="load a LoRA adapter on every cell")
    ll.add_argument("--name", required=True)
    ll.add_argument("--path", required=True)
    ul = sub.add_parser("unload-lora", parents=[common], help="unload a LoRA adapter on every cell")
    ul.add_argument("--name", required=True)
    return p


def _cell_urls(args) -> list[str]:
    urls = list(args.cell)
    if args.cells_file:
        with open(args.cells_file) as f:
            urls += [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]
    return urls


OPS: dict[str, Callable[[Cells, argparse.Namespace], Outcome]] = {
    "pause": lambda c, a: pause(c, a.mode, not a.keep_cache),
    "resume": lambda c, a: resume(c),
    "is-paused": lambda c, a: is_paused(c),
    "update-weights": lambda c, a: update_weights(c, a.path, a.version),
    "load-lora": lambda c, a: load_lora(c, a.name, a.path),
    "unload-lora": lambda c, a: unload_lora(c, a.name),
}


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    key = args.api_key or os.environ.get("TOKSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    try:
        cells = Cells(_cell_urls(args), key, args.timeout)
    except (ValueError, OSError) as exc:
        print(f"tokserve cells: {exc}", file=sys.stderr)
        return 2
    outcome = OPS[args.op](cells, args)
    for r in outcome.results:
        print(json.dumps({"cell": r.cell, "ok": r.ok, "status": r.status, "answer": r.body,
                          **({"error": r.error} if r.error else {})}))
    verdict = "ok" if outcome.ok else "FAILED"
    print(f"{args.op}: {verdict} on {sum(r.ok for r in outcome.results)}/{len(outcome.results)} cell(s)"
          + (f"; {outcome.note}" if outcome.note else ""), file=sys.stderr if not outcome.ok else sys.stdout)
    return 0 if outcome.ok else 1
