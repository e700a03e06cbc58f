"""Every process of an EPD deployment asks for its metrics where the
metrics_port setting says: the engine core (scheduler role) at metrics_port,
worker rank r at metrics_port + 1 + r, on an encoder as on a PD instance.

configure() is process-wide, so the connectors of all four processes are
built here with it recorded rather than applied."""

from __future__ import annotations

import pytest

from vllm_engine import HIDDEN, make_config, require_vllm, tiny_model

require_vllm()

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from ecmooncake import plugin  # noqa: E402
from ecmooncake.connector import lifecycle  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")


def test_each_process_asks_for_its_documented_port(tmp_path, monkeypatch):
    model = tiny_model(tmp_path)
    ec_port = free_port_range(1)
    metrics = 9400
    plugin.register()
    asked: list[dict] = []
    monkeypatch.setattr(lifecycle, "configure", lambda **settings: asked.append(settings))
    layout = [
        ("ec_consumer", ECConnectorRole.SCHEDULER, metrics),
        ("ec_consumer", ECConnectorRole.WORKER, metrics + 1),
        ("ec_producer", ECConnectorRole.SCHEDULER, metrics),
        ("ec_producer", ECConnectorRole.WORKER, metrics + 1),
    ]
    for role, side, port in layout:
        monkeypatch.setattr(lifecycle, "_configured", False)
        asked.clear()
        config = make_config(role, model_dir=model, port=ec_port, buffer_size=16 << 20, extra={"metrics_port": metrics, "log_level": "warn"},
                             widths={"image": 2 * HIDDEN})
        c = ECConnectorFactory.create_connector(config, side)
        try:
            if side == ECConnectorRole.WORKER:
                c.start_worker_services()
            assert [s.get("metrics_port") for s in asked] == [port], f"{role} {side.name}: configure({asked})"
            assert asked[0]["metrics_ip"] == "127.0.0.1"
        finally:
            c.shutdown()
