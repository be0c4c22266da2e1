"""Issue 12's resume scenario against a running engine, the way a router that is not written in
Python would run it: prompts through the OpenAI API (plain HTTP, token-id prompts, the
`X-Session-ID` header) and hints through `buf curl` (gRPC by server reflection; no KvHint code on
the hint path).

    python scripts/resume_scenario.py --http http://127.0.0.1:8000 --grpc 127.0.0.1:50151 [--fillers 6] [--token T]

  first      GetCapabilities by buf curl: the sidecar answers (nothing is sent to the engine before)

  reference  session R: 512 tokens, then the same + 64 new ones: the hit with no pressure
  control    session B: 512 tokens, no hint
  pinned     session A: 512 tokens, then Pin(A, 300 s) by buf curl
  pressure   --fillers unrelated 600-token prompts, no session
  resume     A + 64 new tokens, then B + 64 new tokens: each response's cached tokens
  then Release(A) by buf curl.

Prints one JSON object with every figure. Exit status 0 when the pinned resume hit what the
reference hit and the control's resume hit nothing (the pressure was enough), 1 otherwise, 2 on a
usage or connection error. `--token` (default $KVHINT_TOKEN) is sent as a bearer token with every
hint and reflection request, for an engine with KVHINT_AUTH_TOKEN or a tenants file. A model whose every layer slides (`make-tiny-model --preset window`)
keeps only each prompt's window tail: give it more pressure (`--fillers 30` at 80 blocks).
The engine must serve usage.prompt_tokens_details.cached_tokens (vLLM:
--enable-prompt-tokens-details); `buf` must be on PATH (PyPI buf-bin) or given with --buf.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any


class ScenarioError(Exception):
    """The scenario could not run (a request failed): exit status 2."""


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 4000) for _ in range(n)]


def http_json(url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None, timeout: float = 300) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{url}: {exc}") from exc


def complete(base: str, model: str, prompt: list[int], session: str | None) -> int:
    """One completion of `prompt` (token ids); the cached tokens the response reports."""
    headers = {"X-Session-ID": session} if session else {}
    out = http_json(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}, headers)
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise ScenarioError("the response reports no usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details)")
    return int(details["cached_tokens"] or 0)


def buf_curl(buf: str, grpc: str, method: str, body: dict[str, Any], token: str | None = None) -> Any:
    url = f"http://{grpc}/kvhint.v1.KvHintService/{method}"
    auth = ["-H", f"Authorization: Bearer {token}", "--reflect-header", "*"] if token else []
    out = subprocess.run([buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", *auth, "-d", json.dumps(body), url],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise ScenarioError(f"buf curl {method}: {out.stderr.strip() or out.stdout.strip()}")
    return json.loads(out.stdout)


def check_sidecar(buf: str, grpc: str, token: str | None) -> None:
    """GetCapabilities before any prompt: a wrong --grpc (or token) failed only at the Pin, after
    the reference and control prompts had been sent, with buf's reflection message ("failed to find
    service named ...", which is what a refused connection gives)."""
    try:
        buf_curl(buf, grpc, "GetCapabilities", {}, token)
    except ScenarioError as exc:
        raise ScenarioError(f"cannot reach the KvHint sidecar at {grpc} (nothing was sent to the engine): {exc}") from None


def session_hint(session: str, **action: Any) -> dict[str, Any]:
    return {"hints": [{"selector": {"session": {"sessionId": session}}, **action}]}


def device_blocks(result: dict[str, Any]) -> int:
    """A HintResult's device blocks (proto3 JSON: uint64 as a string, the tier's enum name)."""
    return sum(int(a.get("blocks", 0)) for a in result.get("affectedBlocks", []) if a.get("tier") == "TIER_DEVICE")


def run(http: str, grpc: str, *, fillers: int, tag: str, buf: str, token: str | None = None, prompt_tokens: int = 512,
        filler_tokens: int = 600, turn_tokens: int = 64) -> dict[str, Any]:
    check_sidecar(buf, grpc, token)
    models = http_json(f"{http}/v1/models").get("data") or []
    if not models:
        raise ScenarioError(f"{http}/v1/models lists no model")
    model = models[0]["id"]
    r, a, b = (f"{tag}-{name}" for name in ("R", "A", "B"))
    turn = tokens(f"{tag}-turn", turn_tokens)
    prompts = {s: tokens(s, prompt_tokens) for s in (r, a, b)}
    complete(http, model, prompts[r], r)
    reference = complete(http, model, prompts[r] + turn, r)
    complete(http, model, prompts[b], b)
    complete(http, model, prompts[a], a)
    [pin] = buf_curl(buf, grpc, "ApplyHints", session_hint(a, pin={"ttl": "300s"}), token)["results"]
    for i in range(fillers):
        complete(http, model, tokens(f"{tag}-filler-{i}", filler_tokens), None)
    resumed = complete(http, model, prompts[a] + turn, a)
    control = complete(http, model, prompts[b] + turn, b)
    [release] = buf_curl(buf, grpc, "ApplyHints", session_hint(a, release={}), token)["results"]
    return {
        "model": model,
        "fillers": fillers,
        "reference_cached_tokens": reference,
        "pin_outcome": pin.get("outcome"),
        "pin_device_blocks": device_blocks(pin),
        "pinned_resume_cached_tokens": resumed,
        "control_resume_cached_tokens": control,
        "release_outcome": release.get("outcome"),
        "kept": resumed == reference and reference > 0,
        "pressure_evicted_control": control == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http", required=True, help="the engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--grpc", required=True, help="the KvHint sidecar's HOST:PORT")
    parser.add_argument("--fillers", type=int, default=6, help="unrelated 600-token prompts of pressure (default 6)")
    parser.add_argument("--tag", default="scenario", help="prefix of the session ids and prompt seeds (default scenario)")
    parser.add_argument("--buf", default=None, help="the buf executable (default: buf on PATH)")
    parser.add_argument("--token", default=os.environ.get("KVHINT_TOKEN") or None,
                        help="bearer token for the sidecar (default: $KVHINT_TOKEN)")
    args = parser.parse_args(argv)
    if args.fillers < 0:
        parser.error("--fillers must be >= 0")
    buf = args.buf or shutil.which("buf")
    if not buf:
        parser.error("buf not found: pip install buf-bin, or give --buf")
    try:
        out = run(args.http.rstrip("/"), args.grpc, fillers=args.fillers, tag=args.tag, buf=buf, token=args.token)
    except ScenarioError as exc:
        print(f"resume_scenario: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0 if out["kept"] and out["pressure_evicted_control"] else 1


if __name__ == "__main__":
    sys.exit(main())
