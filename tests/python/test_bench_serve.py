"""bench-serve's pieces that need no server: setups from the command line,
the metrics it reads, the image it warms up with, its table."""

from __future__ import annotations

import argparse
import base64
import io

import pytest

from ecmooncake.tools import bench_serve, fleet


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_setups_follow_the_topologies_baselines_and_faults():
    got = [(s.name, s.kind, s.encoders, s.pds, s.fault) for s in bench_serve.setups(_args("--topologies", "1E1P,2e1p,1E2P", "--fault", "kill-encoder"))]
    assert got == [
        ("single", "single", 0, 0, ""),
        ("example 1E1P", "example", 1, 1, ""),
        ("ecmooncake 1E1P", "ecm", 1, 1, ""),
        ("ecmooncake 2E1P", "ecm", 2, 1, ""),
        ("ecmooncake 1E2P", "ecm", 1, 2, ""),
        ("ecmooncake 2E1P kill-encoder", "ecm", 2, 1, "kill-encoder"),
    ]
    assert [s.name for s in bench_serve.setups(_args("--baselines", "none", "--topologies", "3E2P"))] == ["ecmooncake 3E2P"]


@pytest.mark.parametrize("topo", ["1E", "E1P", "0E1P", "1E0P", "xE1P", "1P"])
def test_a_malformed_topology_is_refused(topo):
    with pytest.raises(ValueError, match="NEmP"):
        bench_serve.setups(_args("--topologies", topo))


def test_bad_rates_and_baselines_are_refused():
    with pytest.raises(ValueError, match="--rates"):
        bench_serve.rates("2,0")
    with pytest.raises(ValueError, match="--baselines"):
        bench_serve.setups(_args("--baselines", "single,other"))
    assert bench_serve.rates("2, inf") == ["2", "inf"]


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


def test_the_table_shows_every_row_and_its_errors():
    rows = [bench_serve.Row("s", "2", completed=23, failed=1, req_per_s=1.5, encoded=23, fallback=1, touched=2, errors=["boom"])]
    out = bench_serve.table("s", rows, "reservations left 0")
    assert "== s (reservations left 0)" in out and "touched" in out and "error: boom" in out
    assert out.splitlines()[3].split()[:3] == ["2", "23", "1"]
