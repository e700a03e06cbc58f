"""bench-serve's pieces that need no server: the fleet and phases planned
from the command line, each phase's checks, the answers of its own client,
the vllm bench serve loop, the metrics it reads, the image it warms up
with, its table."""

from __future__ import annotations

import argparse
import base64
import io
import json

import pytest

from ecmooncake.tools import bench_serve, fleet


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


def _phases(*argv: str) -> list[tuple]:
    return [(ph.name, ph.kind, ph.encoders, ph.pds, ph.fault) for ph in bench_serve.plan(_args(*argv)).phases]


@pytest.mark.parametrize("argv, fleet_shape, baselines, phases", [
    # Every topology and fault on one fleet: the largest topology's
    # instances, the fault that kills an encoder last whatever the order
    # asked, each phase over the fleet's first instances.
    (("--topologies", "1E1P,2e1p,1E2P", "--fault", "kill-encoder", "--fault", "idle-pause", "--fault", "proxy-stop"),
     (2, 2), ("single", "example"), [
         ("single", "single", (), (), ""),
         ("example 1E1P", "example", (), (), ""),
         ("ecmooncake 1E1P", "ecm", (0,), (0,), ""),
         ("ecmooncake 2E1P", "ecm", (0, 1), (0,), ""),
         ("ecmooncake 1E2P", "ecm", (0,), (0, 1), ""),
         ("ecmooncake 1E1P idle-pause", "ecm", (0,), (0,), "idle-pause"),
         ("ecmooncake 1E1P proxy-stop", "ecm", (0,), (0,), "proxy-stop"),
         ("ecmooncake 2E1P kill-encoder", "ecm", (0, 1), (0,), "kill-encoder"),
     ]),
    # The kill needs a second encoder even where no topology has one.
    (("--baselines", "none", "--topologies", "1E1P", "--fault", "kill-encoder"), (2, 1), (), [
        ("ecmooncake 1E1P", "ecm", (0,), (0,), ""),
        ("ecmooncake 2E1P kill-encoder", "ecm", (0, 1), (0,), "kill-encoder"),
    ]),
    (("--baselines", "none", "--topologies", "3E2P,3e2p"), (3, 2), (), [("ecmooncake 3E2P", "ecm", (0, 1, 2), (0, 1), "")]),
    (("--baselines", "example", "--topologies", ""), (0, 0), ("example",), [("example 1E1P", "example", (), (), "")]),
    (("--baselines", "both,single", "--topologies", "1E1P"), (1, 1), ("single", "example"), [
        ("single", "single", (), (), ""), ("example 1E1P", "example", (), (), ""), ("ecmooncake 1E1P", "ecm", (0,), (0,), "")]),
])
def test_the_plan_starts_one_fleet_for_every_phase(argv, fleet_shape, baselines, phases):
    p = bench_serve.plan(_args(*argv))
    assert (p.encoders, p.pds) == fleet_shape
    assert p.baselines == baselines
    assert _phases(*argv) == phases


def test_a_fault_runs_at_the_first_rate_only_and_the_self_driven_ones_at_none():
    rs = ["2", "inf"]
    assert bench_serve.phase_rates(bench_serve.Phase("t", "ecm", (0,), (0,)), rs) == rs
    assert bench_serve.phase_rates(bench_serve.Phase("k", "ecm", (0, 1), (0,), "kill-encoder"), rs) == ["2"]
    assert bench_serve.phase_rates(bench_serve.Phase("i", "ecm", (0,), (0,), "idle-pause"), rs) == ["-"]
    assert bench_serve.phase_rates(bench_serve.Phase("s", "ecm", (0,), (0,), "proxy-stop"), rs) == ["-"]


@pytest.mark.parametrize("topo", ["1E", "E1P", "0E1P", "1E0P", "xE1P", "1P"])
def test_a_malformed_topology_is_refused(topo):
    with pytest.raises(ValueError, match="NEmP"):
        bench_serve.plan(_args("--topologies", topo))


def test_bad_rates_baselines_and_an_empty_plan_are_refused():
    with pytest.raises(ValueError, match="--rates"):
        bench_serve.rates("2,0")
    with pytest.raises(ValueError, match="--baselines"):
        bench_serve.plan(_args("--baselines", "single,other"))
    with pytest.raises(ValueError, match="nothing to run"):
        bench_serve.plan(_args("--baselines", "none", "--topologies", ""))
    assert bench_serve.rates("2, inf") == ["2", "inf"]


TOPO = bench_serve.Phase("ecmooncake 2E1P", "ecm", (0, 1), (0,))
KILL = bench_serve.Phase("ecmooncake 2E1P kill-encoder", "ecm", (0, 1), (0,), "kill-encoder")
IDLE = bench_serve.Phase("ecmooncake 1E1P idle-pause", "ecm", (0,), (0,), "idle-pause")
STOP = bench_serve.Phase("ecmooncake 1E1P proxy-stop", "ecm", (0,), (0,), "proxy-stop")
SINGLE = bench_serve.Phase("single", "single")
EXAMPLE = bench_serve.Phase("example 1E1P", "example")


def _row(**kw) -> bench_serve.Row:
    return bench_serve.Row("s", "2", **kw)


GOOD = dict(completed=24, encoded=24, fallback=0, bytes_moved=24 * 32768, rejected=0)


@pytest.mark.parametrize("phase, row, want", [
    (TOPO, _row(**GOOD), []),
    (TOPO, _row(**{**GOOD, "completed": 23, "failed": 1}), ["1 requests failed"]),
    (TOPO, _row(**{**GOOD, "completed": 20}), ["20 requests ended of 24 sent"]),
    (TOPO, _row(**{**GOOD, "encoded": 23, "fallback": 1}), ["1 items fell back to the PD's own encoder"]),
    (TOPO, _row(**{**GOOD, "encoded": 22, "fallback": 1}), ["22 items encoded, 0 reused and 1 fallen back, of 24 sent",
                                                            "1 items fell back to the PD's own encoder"]),
    # Items encoded but nothing reached a shard: the images were not new.
    (TOPO, _row(**{**GOOD, "bytes_moved": 0}), ["24 items encoded but no byte reached the PD shards"]),
    (TOPO, _row(**{**GOOD, "rejected": 2}), ["the PD shards rejected 2 writes"]),
    (SINGLE, _row(completed=24), []),
    (SINGLE, _row(completed=24, failed=0, fallback=3), []),
    (EXAMPLE, _row(completed=24, encoded=24, fallback=0), []),
    (EXAMPLE, _row(completed=24, encoded=22, fallback=2), ["2 items fell back to the PD's own encoder"]),
    # The kill: fallbacks up to what it touched, and the proxy must stop
    # routing to the killed encoder.
    (KILL, _row(**{**GOOD, "encoded": 22, "fallback": 2, "touched": 2, "unrouted_s": 1.5}), []),
    (KILL, _row(**{**GOOD, "touched": 1, "unrouted_s": 0.2}), []),
    (KILL, _row(**{**GOOD, "encoded": 21, "fallback": 3, "touched": 2, "unrouted_s": 1.5}), ["3 fallbacks, more than the 2 items the kill touched"]),
    (KILL, _row(**{**GOOD, "touched": 2, "unrouted_s": None}), ["the proxy still routed to the killed encoder"]),
    (IDLE, _row(completed=24, encoded=24, fallback=0, bytes_moved=1, rejected=0), []),
    (IDLE, _row(completed=24, encoded=23, fallback=1, bytes_moved=1, rejected=0), ["1 items fell back to the PD's own encoder"]),
    (STOP, _row(completed=2, failed=2, hung=0, dropped=0, proxy_exit_s=0.3), []),
    (STOP, _row(completed=2, failed=2, hung=1, dropped=1, proxy_exit_s=None), [
        "1 requests hung past the deadline after the proxy's SIGTERM",
        "1 requests lost their connection with no HTTP answer",
        "the proxy did not exit after SIGTERM"]),
])
def test_each_phase_checks_its_expected_outcome(phase, row, want):
    assert bench_serve.check(phase, row, 24) == want


def test_answers_tell_an_answer_from_a_refusal_a_drop_and_a_hang():
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            mode = self.path.split("/")[1]
            if mode == "ok":
                body = json.dumps({"choices": [{"message": {"content": "a cat"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif mode == "refuse":
                self.send_error(503, "no PD instance")
            elif mode == "drop":
                self.connection.close()
            else:
                gate.wait(30)

        def log_message(self, *a):
            pass

    gate = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        got = {m: bench_serve.chat(f"{base}/{m}", "m", "data:,", 2, 30 if m != "hang" else 1) for m in ("ok", "refuse", "drop", "hang")}
    finally:
        gate.set()
        srv.shutdown()
        srv.server_close()
    assert {m: a.outcome for m, a in got.items()} == {"ok": "answered", "refuse": "refused", "drop": "dropped", "hang": "hung"}
    assert got["ok"].detail == "a cat" and got["refuse"].detail.startswith("503")


def test_metric_sums_the_samples_whose_labels_include_the_asked_ones():
    text = "\n".join([
        "# HELP ecm_proxy_backend_in_flight x",
        'ecm_proxy_backend_in_flight{role="encode",url="http://a:1"} 3',
        'ecm_proxy_backend_in_flight{role="encode",url="http://b:1"} 1',
        'ecm_proxy_backend_in_flight{role="pd",url="http://a:1"} 7',
        'ecm_proxy_backend_in_flight_other{role="encode",url="http://a:1"} 100',
        "ecm_reservations 2",
    ])
    assert fleet.metric(text, "ecm_proxy_backend_in_flight", role="encode", url="http://a:1") == 3
    assert fleet.metric(text, "ecm_proxy_backend_in_flight", role="encode") == 4
    assert fleet.metric(text, "ecm_proxy_backend_in_flight") == 11
    assert fleet.metric(text, "ecm_reservations") == 2
    assert fleet.metric(text, "ecm_absent") == 0


def test_the_warm_up_image_is_a_png_of_the_asked_size():
    Image = pytest.importorskip("PIL.Image")
    url = bench_serve._png(7, 64)
    assert url.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert img.size == (64, 64) and img.mode == "RGB"
    assert len(img.getcolors(maxcolors=1 << 16) or []) > 100


REUSE_ON = bench_serve.Phase("reuse 1E2P affinity on", "ecm", (0,), (0, 1), reuse="on")
REUSE_OFF = bench_serve.Phase("reuse 1E2P affinity off", "ecm", (0,), (0, 1), reuse="off")


def test_the_reuse_phases_run_on_two_pds_with_affinity_on_then_off():
    p = bench_serve.plan(_args("--baselines", "none", "--topologies", "1E1P", "--reuse", "0.8"))
    assert (p.encoders, p.pds) == (1, 2)
    assert [(ph.name, ph.pds, ph.reuse) for ph in p.phases][1:] == [
        ("reuse 1E2P affinity on", (0, 1), "on"), ("reuse 1E2P affinity off", (0, 1), "off")]
    with pytest.raises(ValueError, match="--reuse"):
        bench_serve.plan(_args("--reuse", "1.5"))
    # Reused items count towards the items sent; with affinity off none may be.
    assert bench_serve.check(REUSE_ON, _row(**{**GOOD, "encoded": 6, "reused": 18}), 24) == []
    assert bench_serve.check(REUSE_OFF, _row(**{**GOOD, "encoded": 22, "reused": 2}), 24) == ["2 items reused with affinity off"]


REUSE_STORE = bench_serve.Phase("reuse 1E2P affinity on + store", "ecm", (0,), (0, 1), reuse="store")


def test_store_host_adds_a_third_reuse_phase_with_the_proxys_store_reuse():
    p = bench_serve.plan(_args("--baselines", "none", "--topologies", "1E1P", "--reuse", "0.8", "--store-host", "10.231.0.1"))
    assert [(ph.name, ph.pds, ph.reuse) for ph in p.phases][1:] == [
        ("reuse 1E2P affinity on", (0, 1), "on"), ("reuse 1E2P affinity off", (0, 1), "off"),
        ("reuse 1E2P affinity on + store", (0, 1), "store")]
    with pytest.raises(ValueError, match="--store-host"):
        bench_serve.plan(_args("--store-host", "10.231.0.1"))
    # Items from the Store count towards the items sent; only the Store
    # phase may send any, and there no PD may encode an item itself.
    ok = {**GOOD, "encoded": 6, "reused": 12, "store": 6, "fetched": 6, "local": 0}
    assert bench_serve.check(REUSE_STORE, _row(**ok), 24) == []
    assert bench_serve.check(REUSE_STORE, _row(**{**ok, "local": 2}), 24) == [
        "2 items encoded by the PDs themselves (a Store fetch that failed)"]
    assert bench_serve.check(REUSE_ON, _row(**ok), 24) == ["6 items sent from the Store without --store-reuse"]
    assert bench_serve.check(REUSE_STORE, _row(**{**ok, "store": 4}), 24) == [
        "6 items encoded, 12 reused, 4 from the Store and 0 fallen back, of 24 sent"]


def test_the_reuse_dataset_repeats_about_the_asked_fraction_of_its_images(tmp_path):
    path = tmp_path / "d.jsonl"
    distinct = bench_serve.reuse_dataset(path, 200, 0.8, 16, seed=7)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    urls = [x["content"][0]["image_url"]["url"] for x in lines]
    assert len(lines) == 200 and len(set(urls)) == distinct
    assert 20 <= distinct <= 60, distinct  # about 40 new images for 200 requests at 0.8
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    assert [x["content"][1] for x in lines] == [{"type": "text", "text": "What is in this image?"}] * 200
    # The same seed writes the same requests; another seed, other images.
    again = tmp_path / "e.jsonl"
    bench_serve.reuse_dataset(again, 200, 0.8, 16, seed=7)
    assert again.read_text() == path.read_text()
    other = tmp_path / "f.jsonl"
    bench_serve.reuse_dataset(other, 200, 0.8, 16, seed=8)
    assert not set(urls) & {json.loads(x)["content"][0]["image_url"]["url"] for x in other.read_text().splitlines()}


def test_the_table_shows_every_row_and_its_errors():
    rows = [bench_serve.Row("s", "2", completed=23, failed=1, req_per_s=1.5, encoded=23, fallback=1, touched=2, errors=["boom"])]
    out = bench_serve.table("s", rows, "reservations left 0")
    assert "== s (reservations left 0)" in out and "touched" in out and "error: boom" in out
    assert out.splitlines()[3].split()[:3] == ["2", "23", "1"]


def test_the_table_shows_the_fault_columns_and_failed_checks_only_where_they_apply():
    plain = bench_serve.table("t", [bench_serve.Row("t", "2", completed=24)])
    assert "touched" not in plain and "hung" not in plain and "CHECK FAILED" not in plain
    rows = [bench_serve.Row("k", "2", completed=24, touched=1, unrouted_s=2.5, problems=["the proxy still routed to the killed encoder"])]
    out = bench_serve.table("k", rows, "12 s")
    assert "unrouted after s" in out and "2.5" in out and "CHECK FAILED: the proxy still routed" in out


def test_the_client_loop_runs_each_line_and_reports_every_end_in_its_done_file(tmp_path):
    from ecmooncake.tools import vllm_cli

    seen = []

    def run(argv):
        seen.append(argv)
        if argv == ["boom"]:
            raise ValueError("no such dataset")
        if argv == ["exit"]:
            raise SystemExit(2)  # argparse's way of refusing an argument

    lines = [json.dumps({"argv": a, "done": str(tmp_path / f"{i}.done")}) for i, a in enumerate([["a", "1"], ["boom"], ["exit"]])]
    lines.insert(1, "not json")
    lines.append("")
    assert vllm_cli.serve_loop(lines, run) == 3
    assert seen == [["a", "1"], ["boom"], ["exit"]]
    assert (tmp_path / "0.done").read_text() == "0\n"
    assert (tmp_path / "1.done").read_text().startswith("1\nValueError: no such dataset")
    assert (tmp_path / "2.done").read_text().startswith("1\nSystemExit: 2")
    assert not list(tmp_path.glob("*.tmp"))


def test_a_self_driven_phase_shows_its_unmeasured_latencies_as_dashes():
    row = bench_serve.Row("ecmooncake 1E1P idle-pause", "-")
    bench_serve._count([bench_serve.Answer("answered", "a cat")] * 8 + [bench_serve.Answer("refused", "503: no PD instance")], row)
    assert (row.completed, row.failed) == (8, 1)
    assert row.errors == ["refused: 503: no PD instance"]
    line = bench_serve.table("i", [row]).splitlines()[3].split()
    assert line[:9] == ["-", "8", "1", "-", "-", "-", "-", "-", "-"]
