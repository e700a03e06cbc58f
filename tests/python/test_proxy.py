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
import urllib.error
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


TOKEN = "python-test-register-token"


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


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
    with Proxy({"host": "127.0.0.1", "port": 0, "register_token": TOKEN}) as proxy:
        reg = Registrar({"proxies": [f"http://{proxy.address}"], "role": "pd", "url": pd_server, "consumer": "tcp://127.0.0.1:15000", "dp_size": 2, "ttl_s": 2, "token": TOKEN})
        _wait(lambda: len(proxy.backends()["pd"]) == 1, "the registration reaches the proxy")
        assert proxy.backends()["pd"][0]["dp_size"] == 2
        for _ in range(2):
            code, _ = _post(f"http://{proxy.address}/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert code == 200
        assert sorted(s["rank"] for s in _PD.seen) == ["0", "1"]
        assert reg.stats()["heartbeats"] >= 1
        reg.close()
        assert proxy.backends()["pd"] == []


def test_registration_needs_the_token(library, pd_server):
    reg = {"role": "pd", "url": pd_server, "consumer": "tcp://127.0.0.1:15000"}
    with Proxy({"host": "127.0.0.1", "port": 0, "pd": ["http://127.0.0.1:1"]}) as proxy:
        code, body = _post(f"http://{proxy.address}/v1/ecm/register", reg, token=TOKEN)
        assert code == 403 and "registration is off" in body["error"]["message"]
    with Proxy({"host": "127.0.0.1", "port": 0, "register_token": TOKEN}) as proxy:
        anon = Registrar({"proxies": [f"http://{proxy.address}"], **reg, "ttl_s": 2})
        _wait(lambda: anon.stats()["failures"] > 0, "the registrar without a token is refused")
        assert "401" in anon.stats()["last_error"][f"http://{proxy.address}"]
        anon.close()
        assert proxy.backends()["pd"] == []
        code, _ = _post(f"http://{proxy.address}/v1/ecm/register", reg, token="wrong")
        assert code == 401 and proxy.backends()["pd"] == []
        assert 'ecm_proxy_registration_refusals_total{op="register",reason="bad_token"} 1' in _get(f"http://{proxy.address}/metrics")


def _get(url: str, token: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def test_bad_settings_are_refused(library):
    with pytest.raises(EcmInvalid, match="retries"):
        Proxy({"pd": ["http://h:1"], "retries": 99})
    with pytest.raises(EcmInvalid, match="unknown field"):
        Proxy({"pdd": []})
    with pytest.raises(EcmInvalid, match="proxies"):
        Registrar({"role": "pd", "url": "http://h:1", "consumer": "tcp://h:2"})
    with pytest.raises(EcmInvalid, match="upstream_idle_timeout_s"):
        Proxy({"pd": ["http://h:1"], "upstream_idle_timeout_s": 0})


def test_upstream_idle_timeout_reaches_the_config(library):
    import argparse

    from ecmooncake.tools.proxy import add_proxy_arguments, proxy_config

    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    assert proxy_config(p.parse_args([]))["upstream_idle_timeout_s"] == 4
    cfg = proxy_config(p.parse_args(["--pd", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port", "0", "--upstream-idle-timeout", "2.5"]))
    assert cfg["upstream_idle_timeout_s"] == 2.5
    Proxy(cfg).close()


def test_health_timeout_reaches_the_proxy(library, capsys):
    import argparse

    from ecmooncake.tools.proxy import add_proxy_arguments, proxy_config, proxy_main

    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    # 0 leaves the bound to the proxy: the interval, at most 5 s.
    assert proxy_config(p.parse_args([]))["health_timeout_s"] == 0
    base = ["--pd", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port", "0", "--no-register"]
    cfg = proxy_config(p.parse_args(base + ["--health-timeout", "30"]))
    assert cfg["health_timeout_s"] == 30
    Proxy(cfg).close()
    # The proxy itself checks the flag's value, and the command says so.
    assert proxy_main(p.parse_args(base + ["--health-timeout", "-1"])) == 2
    assert "health_timeout_s" in capsys.readouterr().err


def test_body_budget_reaches_the_config(library):
    import argparse

    from ecmooncake.tools.proxy import add_proxy_arguments, proxy_config

    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    cfg = proxy_config(p.parse_args([]))
    assert (cfg["max_body_bytes"], cfg["max_bodies_in_flight"], cfg["max_body_bytes_per_client"]) == (256 << 20, 8, 0)
    assert (cfg["client_media_keys"], cfg["tenant_header"]) == ("namespace", "")
    assert (cfg["affinity_entries"], cfg["affinity_ttl_s"], cfg["affinity_slack"], cfg["affinity_reuse"]) == (1 << 16, 300, 2, True)
    assert cfg["store_reuse"] is False and proxy_config(p.parse_args(["--store-reuse"]))["store_reuse"] is True
    assert proxy_config(p.parse_args(["--client-media-keys", "refuse", "--tenant-header", "X-Tenant"]))["tenant_header"] == "X-Tenant"
    cfg = proxy_config(p.parse_args(["--pd", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port", "0",
                                     "--max-body-bytes", str(1 << 20), "--max-bodies-in-flight", "3",
                                     "--max-body-bytes-per-client", str(2 << 20)]))
    assert (cfg["max_body_bytes"], cfg["max_bodies_in_flight"], cfg["max_body_bytes_per_client"]) == (1 << 20, 3, 2 << 20)
    Proxy(cfg).close()
    with pytest.raises(EcmInvalid, match="max_bodies_in_flight"):
        Proxy({**cfg, "max_bodies_in_flight": 0})
    with pytest.raises(EcmInvalid, match="max_body_bytes_per_client"):
        Proxy({**cfg, "max_body_bytes_per_client": 1 << 10})


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


def test_command_lines_take_the_token_from_env_and_file(library, pd_server, tmp_path):
    port, admin = _free_port(), _free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    proxy = subprocess.Popen(
        [sys.executable, "-m", "ecmooncake", "proxy", "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin)],
        env=subprocess_env(ECMOONCAKE_REGISTER_TOKEN=TOKEN), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    sidecar = None
    try:
        banner = proxy.stdout.readline()
        assert f"registration on the admin port http://127.0.0.1:{admin}" in banner, banner + proxy.stderr.read()
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "ecmooncake", "register", "--proxy", f"http://127.0.0.1:{admin}", "--role", "pd",
             "--url", pd_server, "--consumer", "tcp://127.0.0.1:15000", "--ttl", "3", "--token-file", str(token_file)],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        _wait(lambda: pd_server in _get(f"http://127.0.0.1:{admin}/v1/ecm/backends", TOKEN), "the sidecar registers with the token from its file")
        with open(f"/proc/{sidecar.pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
        code, _ = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert code == 200
        code, _ = _post(f"http://127.0.0.1:{port}/v1/ecm/register", {}, token=TOKEN)
        assert code == 404, "the user port serves no discovery when an admin port is set"
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=20) == 0
        assert pd_server not in _get(f"http://127.0.0.1:{admin}/v1/ecm/backends", TOKEN), "deregistered with the token"
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=20) == 0
    finally:
        for p in (sidecar, proxy):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_command_line_without_backends_or_token_says_what_is_missing(library):
    out = subprocess.run([sys.executable, "-m", "ecmooncake", "proxy", "--host", "127.0.0.1", "--port", str(_free_port())],
                         env=subprocess_env(ECMOONCAKE_REGISTER_TOKEN=""), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "registration is off" in out.stderr and "--register-token-file" in out.stderr and "Traceback" not in out.stderr


def test_token_flag_warns_and_token_files_are_checked(tmp_path):
    from ecmooncake.tools.proxy import add_proxy_arguments, register_token
    from ecmooncake.tokens import TokenError
    import argparse

    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        register_token(parser.parse_args(["--register-token-file", str(empty)]))
    with pytest.raises(TokenError, match="not both"):
        register_token(parser.parse_args(["--register-token-file", str(empty), "--register-token", "x"]))
    with pytest.raises(TokenError, match="cannot read"):
        register_token(parser.parse_args(["--register-token-file", str(tmp_path / "missing")]))
    out = subprocess.run(
        [sys.executable, "-c", "import sys, argparse; from ecmooncake.tools.proxy import add_proxy_arguments, register_token;"
         "p = argparse.ArgumentParser(); add_proxy_arguments(p); print(register_token(p.parse_args(sys.argv[1:])))",
         "--register-token", "flagtoken"],
        env=subprocess_env(ECMOONCAKE_REGISTER_TOKEN="envtoken"), capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "flagtoken"
    assert "/cmdline" in out.stderr and "--register-token-file" in out.stderr
    out = subprocess.run(
        [sys.executable, "-c", "import argparse; from ecmooncake.tools.proxy import add_proxy_arguments, register_token;"
         "p = argparse.ArgumentParser(); add_proxy_arguments(p); print(register_token(p.parse_args([])))"],
        env=subprocess_env(ECMOONCAKE_REGISTER_TOKEN="envtoken"), capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "envtoken" and out.stderr == ""


def test_console_script_help():
    out = subprocess.run([sys.executable, "-c", "from ecmooncake.tools.proxy import console_main; console_main(['--help'])"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert "--encode" in out.stdout and "--retries" in out.stdout
