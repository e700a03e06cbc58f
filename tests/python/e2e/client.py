"""The end-to-end test's client: sends chat requests and scrapes metrics.

Reads a plan as JSON on stdin and prints the results as JSON on stdout, so
that the test can run it inside a network namespace (``ip netns exec``)
exactly as it runs it beside the servers. Standard library only, and
ecmooncake.tools.fleet (itself standard library only) from the vLLM
environment's install, for the wait until the proxy is healthy.

Plan: {"url": "http://host:port", "model": "...", "requests": [{"image":
"data:...", "stream": bool, "text": "...", and optionally "uuid": the
image part's cache key, "token": a bearer token}], "max_tokens": N,
"metrics": ["http://host:port/metrics", ...], "timeout_s": T}

Result: {"answers": [{"tokens": [id, ...], "logprobs": [float, ...],
"text": "..."}], "metrics": {url: text}}; a request that fails prints its
status and body and exits 1.

With "concurrency": N the requests are sent N at a time, and with
"keep_going": true a request that fails is answered {"error": "..."} in its
place (its status and the body's first 2000 characters) instead.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request

from ecmooncake.tools import fleet


def _body(plan: dict, req: dict) -> dict:
    image = {"type": "image_url", "image_url": {"url": req["image"]}}
    if "uuid" in req:
        image["uuid"] = req["uuid"]  # a cache key of the client's choosing
    return {
        "model": plan["model"],
        "temperature": 0,
        "max_tokens": plan["max_tokens"],
        "logprobs": True,
        "top_logprobs": 1,
        # Tokens come back as "token_id:N": the ids themselves are compared.
        "return_tokens_as_token_ids": True,
        "stream": req["stream"],
        "messages": [
            {
                "role": "user",
                "content": [image, {"type": "text", "text": req["text"]}],
            }
        ],
    }


def _token_id(entry: dict) -> int:
    token = entry["token"]
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not in the token_id:N form")
    return int(token.split(":", 1)[1])


def _answer(plan: dict, req: dict) -> dict:
    data = json.dumps(_body(plan, req)).encode()
    headers = {"Content-Type": "application/json"}
    if "token" in req:
        headers["Authorization"] = f"Bearer {req['token']}"  # the client's credential: its tenant at the proxy
    http = urllib.request.Request(plan["url"] + "/v1/chat/completions", data=data, headers=headers)
    tokens: list[int] = []
    logprobs: list[float] = []
    text = []
    with urllib.request.urlopen(http, timeout=plan["timeout_s"]) as resp:
        if not req["stream"]:
            reply = json.load(resp)
            choice = reply["choices"][0]
            for entry in choice["logprobs"]["content"]:
                tokens.append(_token_id(entry))
                logprobs.append(entry["logprob"])
            return {"tokens": tokens, "logprobs": logprobs, "text": choice["message"]["content"]}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    tokens.append(_token_id(entry))
                    logprobs.append(entry["logprob"])
    return {"tokens": tokens, "logprobs": logprobs, "text": "".join(text)}


def main() -> int:
    plan = json.load(sys.stdin)
    out: dict = {"answers": [], "metrics": {}}
    try:
        fleet.wait_healthy(plan["url"], plan.get("healthy_within_s", 60))
    except fleet.ServerError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    def one(i: int, req: dict) -> dict:
        try:
            return _answer(plan, req)
        except urllib.error.HTTPError as exc:
            return {"error": f"request {i} answered {exc.code}: {exc.read().decode(errors='replace')[:2000]}"}
        except Exception as exc:  # the test prints it with the servers' logs
            return {"error": f"request {i} failed: {type(exc).__name__}: {exc}"}

    with ThreadPoolExecutor(max_workers=max(1, plan.get("concurrency", 1))) as pool:
        answers = list(pool.map(one, range(len(plan["requests"])), plan["requests"]))
    for a in answers:
        if "error" in a and not plan.get("keep_going"):
            print(a["error"], file=sys.stderr)
            return 1
    out["answers"] = answers
    for url in plan.get("metrics", []):
        # A vLLM process that runs its engine core and its worker in one
        # process serves the library's series on one of its two ports only.
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                out["metrics"][url] = resp.read().decode()
        except OSError as exc:
            out["metrics"][url] = ""
            print(f"metrics {url}: {exc}", file=sys.stderr)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
