"""One of two encoders killed while a client sends, end to end on a CPU.

Two encoders and one PD instance (ECMooncakeConnector over tcp) behind the
proxy; a client sends distinct-image requests all at once. Encoder A's
process group is stopped (SIGSTOP) as soon as it holds an item, and held
so until every item has been either encoded or handed to A and B has
nothing in flight: the items
then at A are the ones the fault touches, read off the proxy's own in-flight
gauge, and nothing can change that count while A is stopped. A is then
SIGKILLed, which ends its connections.

A touched item may be encoded again by B (the proxy tries a second encoder
when the first cannot be reached) or fall back to the PD instance's own
encoder; so the fallbacks plus B's encodes after the kill (B's own
vllm:request_success_total, read before and after) must equal the touched
count exactly, and no item that A did not hold may fall back. Every request
answers with the single instance's tokens (greedy) or a clear error; the
proxy's counts agree with the client's and with the PD shard's, and the
shard has no write, cancel or expiry left pending once the run is over.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from servers import (
    CLIENT,
    PROXY_READY,
    PYTHON,
    VLLM_READY,
    Deployment,
    ServerError,
    child_env,
    metric,
    require_venv,
    run_client,
    run_in,
    vllm_argv,
)

require_venv()

from ecmooncake.tools import fleet  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

MAX_TOKENS = 4
REQUESTS = 8
# All at once: a request whose item the stopped encoder holds holds its
# client slot too, and every item must reach an encoder for the count.
CONCURRENCY = REQUESTS
# Every wait is bounded, and generously: vLLM on a shared 2-core machine.
WAIT_S = 300


# conftest's per-test deadline (its watchdog stops every server the test
# started), longer: this test starts four vLLM
# instances one after another's phase on a shared machine.
pytestmark = pytest.mark.deadline(1800, env="ECMOONCAKE_E2E_DEADLINE_S")


def _png(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def requests_() -> list[dict]:
    pytest.importorskip("PIL")
    return [{"image": _png(100 + i), "stream": i % 2 == 1, "text": "What is in this image?"} for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2-vl")
    run_in(None, [str(PYTHON), "-m", "ecmooncake", "tiny-model", str(out)], timeout_s=600)
    return out


# The PD's lease, short so that the killed encoder's grants end within the
# test, and longer than its push wait so that no live item expires.
LEASE_S = 60


def _plan(url: str, model: Path, requests_: list[dict], **extra) -> dict:
    return {"url": url, "model": str(model), "requests": requests_, "max_tokens": MAX_TOKENS, "timeout_s": WAIT_S, **extra}


def _eventually(what: str, check, timeout_s: float = WAIT_S, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(every_s)


def test_one_of_two_encoders_killed_under_load(model, requests_, tmp_path):
    logs = tmp_path / "logs"
    # The single instance: the answers every request must match.
    port = free_port_range(1)
    d = Deployment(logs / "baseline")
    try:
        d.start("vllm", vllm_argv(model, port), ready=VLLM_READY)
        d.wait_ready()
        baseline = run_client(_plan(f"http://127.0.0.1:{port}", model, requests_))["answers"]
    except ServerError as exc:
        pytest.fail(f"baseline: {exc}\n{d.logs()}")
    finally:
        d.stop()
    assert all(len(a["tokens"]) == MAX_TOKENS for a in baseline)

    base = free_port_range(8)
    pd_http, enc_a, enc_b, proxy_port, proxy_metrics, ec_port, pd_metrics = base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6
    d = Deployment(logs / "fleet")
    client = None
    try:
        pd_ec = fleet.ecm_config("ec_consumer", "127.0.0.1", ec_port, {"transport": "tcp", "metrics_port": pd_metrics, "push_wait_timeout_s": 50, "lease_s": LEASE_S})
        enc_ec = fleet.ecm_config("ec_producer", "127.0.0.1", ec_port, {"transport": "tcp"})
        d.start("pd", vllm_argv(model, pd_http, ec=pd_ec), ready=VLLM_READY)
        a = d.start("encoder-a", vllm_argv(model, enc_a, ec=enc_ec), ready=VLLM_READY)
        d.start("encoder-b", vllm_argv(model, enc_b, ec=enc_ec), ready=VLLM_READY)
        d.wait_ready()
        url_a, url_b = f"http://127.0.0.1:{enc_a}", f"http://127.0.0.1:{enc_b}"
        # An encoder call outlasts the time A is held stopped: a touched
        # item is touched by the kill, not by the proxy's encode timeout.
        d.start("proxy", fleet.proxy_argv(PYTHON, proxy_port, proxy_metrics, [url_a, url_b],
                                          [(f"http://127.0.0.1:{pd_http}", f"tcp://127.0.0.1:{ec_port}")],
                                          extra=("--encode-timeout", "900")), ready=PROXY_READY)
        d.wait_ready()
        proxy_url = f"http://127.0.0.1:{proxy_metrics}/metrics"
        pd_urls = [f"http://127.0.0.1:{pd_metrics}/metrics", f"http://127.0.0.1:{pd_metrics + 1}/metrics"]

        def proxy_m() -> str:
            return fleet.scrape(proxy_url)

        def in_flight(text: str, url: str) -> float:
            return metric(text, "ecm_proxy_backend_in_flight", role="encode", url=url)

        plan = _plan(f"http://127.0.0.1:{proxy_port}", model, requests_, concurrency=CONCURRENCY, keep_going=True)
        # The plan and the answers go through files: the test polls metrics
        # while the client runs, and reads its output once it ended.
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        with open(tmp_path / "plan.json", "rb") as stdin, open(tmp_path / "answers.json", "wb") as stdout, open(tmp_path / "client.err", "wb") as stderr:
            client = subprocess.Popen([str(PYTHON), str(CLIENT)], stdin=stdin, stdout=stdout, stderr=stderr, env=child_env())

        # Under load: A stops as soon as the proxy has an item at it.
        _eventually("an item at encoder A", lambda: in_flight(proxy_m(), url_a) >= 1, every_s=0.05)
        a.signal_group(signal.SIGSTOP)

        def settled():
            text = proxy_m()
            encoded = metric(text, "ecm_proxy_media_items_total", outcome="encoded")
            held = in_flight(text, url_a)
            if encoded + held == REQUESTS and in_flight(text, url_b) == 0 and held >= 1:
                return text
            return None

        # Every item is now encoded or held by the stopped A, and B is idle,
        # so neither count below can move until A is killed.
        at_freeze = _eventually("every item encoded or held by the stopped encoder, at least one held", settled)
        touched = int(in_flight(at_freeze, url_a))
        encoded_at_freeze = int(metric(at_freeze, "ecm_proxy_media_items_total", outcome="encoded"))
        b_before = metric(fleet.scrape(url_b + "/metrics"), "vllm:request_success_total")
        a.signal_group(signal.SIGKILL)

        client.wait(timeout=WAIT_S)
        assert client.returncode == 0, (tmp_path / "client.err").read_text(errors="replace")[-4000:]
        answers = json.loads((tmp_path / "answers.json").read_text())["answers"]

        # Every request answers with the single instance's tokens, or fails
        # with an error that says what happened.
        failed = [x["error"] for x in answers if "error" in x]
        for x in failed:
            assert re.search(r"(answered \d{3}|failed: \w+): \S", x), f"an unclear failure: {x}"
        for i, (got, want) in enumerate(zip(answers, baseline)):
            if "error" not in got:
                assert got["tokens"] == want["tokens"], f"request {i}: tokens differ from the single instance"

        proxy = _eventually("the proxy's in-flight counts back at zero",
                            lambda: (t := proxy_m()) and in_flight(t, url_b) == 0 and in_flight(t, url_a) == 0 and t)
        encoded = int(metric(proxy, "ecm_proxy_media_items_total", outcome="encoded"))
        fallback = int(metric(proxy, "ecm_proxy_media_items_total", outcome="fallback"))
        b_after = metric(fleet.scrape(url_b + "/metrics"), "vllm:request_success_total")
        reencoded = int(b_after - b_before)
        summary = (f"touched {touched}, encoded at the freeze {encoded_at_freeze}, encoded {encoded}, fallback {fallback}, "
                   f"re-encoded by B {reencoded}, failed requests {len(failed)}")
        print(summary)
        assert encoded + fallback == REQUESTS, summary
        assert fallback + reencoded == touched, summary
        assert encoded == encoded_at_freeze + reencoded, summary
        # The proxy's answers agree with the client's.
        assert metric(proxy, "ecm_proxy_requests_total", outcome="ok") == REQUESTS - len(failed), proxy
        assert metric(proxy, "ecm_proxy_requests_total") == REQUESTS, proxy

        # Loaded items stay in the slab: as views vLLM's encoder cache still
        # holds (it frees entries only when it needs the room), then as
        # resident copies (the shard's LRU of images). So what must be left
        # is no write, cancel or expiry still pending on the shard.
        def shard():
            text = "\n".join(fleet.scrape(u) for u in pd_urls)
            pending = sum(metric(text, "ecm_reservations", state=st) for st in ("WRITING", "CANCEL_PENDING", "EXPIRE_PENDING"))
            return text if pending == 0 else None

        # The killed encoder's own grants have no writer left: the lease
        # ends them, then a second lease frees them (a timeout cannot prove
        # a writer stopped, so the shard waits twice).
        pd = _eventually("no write, cancel or expiry left pending on the PD shard", shard, timeout_s=2 * LEASE_S + 120)
        # The shard saw every item that was encoded arrive, and none twice:
        # a re-encoded item reuses its transfer id.
        assert metric(pd, "ecm_transfer_wait_seconds_count") == encoded, pd
        assert metric(pd, "ecm_rejected_writes_total") == 0, pd
    except ServerError as exc:
        pytest.fail(f"{exc}\n{d.logs()}")
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{d.logs()}", pytrace=True)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        d.stop()
