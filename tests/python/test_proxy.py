"""The EPD proxy through the library: a stand-in PD server in this process
(stdlib HTTP), the proxy in front of it, the registrar, the metrics text and
the command line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import subprocess_env
from ecmooncake import EcmInvalid
from ecmooncake.proxy import Proxy, Registrar, metrics_text


class _PD(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "body": body, "rank": self.headers.get("X-data-parallel-rank")})
        out = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def pd_server():
    _PD.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _PD)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read())


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"still not true after {timeout}s: {what}")
        time.sleep(0.02)


def test_proxy_forwards_and_reports(library, pd_server):
    with Proxy({"host": "127.0.0.1", "port": 0, "pd": [pd_server]}) as proxy:
        code, answer = _post(f"http://{proxy.address}/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}]})
        assert code == 200 and answer["choices"][0]["message"]["content"] == "hi"
        assert _PD.seen[0]["body"]["messages"][0]["content"] == "hello"
        stats = proxy.stats()
        assert stats["requests_served"] == 1
        assert [b["url"] for b in stats["backends"]["pd"]] == [pd_server]
    assert proxy.closed


def test_registrar_adds_a_consumer(library, pd_server):
    with Proxy({"host": "127.0.0.1", "port": 0}) as proxy:
        reg = Registrar({"proxies": [f"http://{proxy.address}"], "role": "pd", "url": pd_server, "consumer": "tcp://127.0.0.1:15000", "dp_size": 2, "ttl_s": 2})
        _wait(lambda: len(proxy.backends()["pd"]) == 1, "the registration reaches the proxy")
        assert proxy.backends()["pd"][0]["dp_size"] == 2
        for _ in range(2):
            code, _ = _post(f"http://{proxy.address}/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert code == 200
        assert sorted(s["rank"] for s in _PD.seen) == ["0", "1"]
        assert reg.stats()["heartbeats"] >= 1
        reg.close()
        assert proxy.backends()["pd"] == []


def test_bad_settings_are_refused(library):
    with pytest.raises(EcmInvalid, match="retries"):
        Proxy({"pd": ["http://h:1"], "retries": 99})
    with pytest.raises(EcmInvalid, match="unknown field"):
        Proxy({"pdd": []})
    with pytest.raises(EcmInvalid, match="proxies"):
        Registrar({"role": "pd", "url": "http://h:1", "consumer": "tcp://h:2"})


def test_metrics_text(library):
    text = metrics_text()
    assert "# TYPE go_goroutines gauge" in text
    assert "ecm_transfer_bytes_total" in text or "ecm_failures_total" in text or "process_cpu_seconds_total" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_line_runs_until_sigterm(library, pd_server):
    port, mport = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecmooncake", "proxy", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport), "--pd", pd_server],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        banner = proc.stdout.readline()
        assert f"listening on http://127.0.0.1:{port}" in banner, banner + proc.stderr.read()
        code, _ = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert code == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as resp:
            assert 'ecm_proxy_requests_total{outcome="ok",route="chat"} 1' in resp.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_console_script_help():
    out = subprocess.run([sys.executable, "-c", "from ecmooncake.proxy import console_main; console_main(['--help'])"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert "--encode" in out.stdout and "--retries" in out.stdout
