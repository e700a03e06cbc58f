"""The connector with CUDA tensors, through its hooks: an encoder worker on a
GPU pushes to a PD whose slab is GPU memory, over cuda_ipc (same host) and
over staged TCP (a PD that reports another host), with TP=2 where there are
two GPUs. Every loaded tensor is compared bit for bit with what the encoder
made, on the PD's GPU.

vLLM cannot be installed on the GPU host: ecmooncake.tools.connector_gpu
stands in for what vLLM provides (the connector's base class, configs,
requests, scheduler output) and drives the scheduler roles here and the
worker roles in spawned processes, in the order vLLM calls the hooks (as
tests/python/vllm_engine.py does with vLLM's own objects). Skips without
CUDA.
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from ecmooncake.tools import connector_gpu as cg  # noqa: E402
from ecmooncake.tools.harness import free_port_range  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

MiB = 1 << 20
WIDTH = 2048
# About a second of GPU time on a current GPU: save_caches returns within
# microseconds, so the kernel is still running when it does.
SLEEP_CYCLES = int(2e9)
TWO_GPUS = torch.cuda.device_count() >= 2


@pytest.fixture
def deploy():
    made = []

    def start(**kwargs):
        tp = kwargs.get("tp_size", 1)
        dep = cg.Deployment.start(port=free_port_range(tp), buffer_size=256 * MiB, width=WIDTH, **kwargs)
        made.append(dep)
        return dep

    yield start
    for dep in made:
        dep.close()


def items(tag: str, sizes_mib: list[float]) -> list[cg.Item]:
    return [cg.Item(f"{tag}-i{i}", max(1, int(mib * MiB) // (WIDTH * 2)), WIDTH) for i, mib in enumerate(sizes_mib)]


def run_request(dep: cg.Deployment, tag: str, its: list[cg.Item], sleep_cycles: int = 0) -> tuple[dict, list[dict]]:
    sent = dep.encode(tag, its, sleep_cycles=sleep_cycles)
    assert not sent["failed"], f"pushes failed: {sent['failed']}"
    req = dep.wait_available(tag, its)
    results = dep.load(req, its)
    for rank, r in enumerate(results):
        assert r["verdicts"] == {it.identifier: "ok" for it in its}, f"rank {rank}: {r['verdicts']}"
    dep.free(req)
    return sent, results


PATHS = {"cuda_ipc": {}, "staged tcp": cg.ELSEWHERE}
PLANE = {"cuda_ipc": "cuda_ipc", "staged tcp": "tcp"}


def test_the_stand_ins_import_no_vllm():
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("path", list(PATHS))
def test_encoder_outputs_arrive_bit_for_bit_in_a_gpu_slab(deploy, path):
    dep = deploy(pd_extra=PATHS[path])
    assert dep.ranks[0].call("slab") == {"memory": "device", "device": "cuda:0"}
    # Odd sizes too: an item need not fill whole pages or chunks.
    its = items(f"{path[:3]}", [0.25, 4, 9.5, 33])
    _, results = run_request(dep, "a", its)
    assert set(results[0]["where"].values()) == {"cuda:0"}, "loads are views of the GPU slab"
    # A second request reuses the mapping or connections.
    run_request(dep, "b", items(f"{path[:3]}b", [4] * 8))
    planes = cg.planes(dep.ranks[0])
    other = "tcp" if PLANE[path] == "cuda_ipc" else "cuda_ipc"
    assert planes.get(PLANE[path], 0) > 0, f"{path} carried nothing: {planes}"
    assert planes.get(other, 0) == 0, f"{other} carried items too: {planes}"


@pytest.mark.parametrize("path", list(PATHS))
def test_an_output_is_read_only_after_the_kernel_that_writes_it(deploy, path):
    dep = deploy(pd_extra=PATHS[path])
    its = items(f"slow-{path[:3]}", [16])
    sent, _ = run_request(dep, "slow", its, sleep_cycles=SLEEP_CYCLES)
    assert sent["busy"] == {its[0].identifier: True}, "the encoder's kernel had finished before save_caches returned; the proof proves nothing"


def test_a_pinned_host_slab_is_an_explicit_choice_copied_at_load(deploy):
    dep = deploy(pd_extra={"buffer_memory": "pinned_host"})
    assert dep.ranks[0].call("slab") == {"memory": "pinned_host", "device": "cpu"}
    _, results = run_request(dep, "p", items("pinned", [1, 8]))
    assert set(results[0]["where"].values()) == {"cuda:0"}
    assert cg.planes(dep.ranks[0]).get("tcp", 0) > 0


@pytest.mark.skipif(not TWO_GPUS, reason="TP=2 needs two GPUs")
@pytest.mark.parametrize("path", list(PATHS))
def test_every_tp_rank_receives_every_item_on_its_own_gpu(deploy, path):
    dep = deploy(tp_size=2, pd_extra=PATHS[path])
    assert [w.call("slab")["device"] for w in dep.ranks] == ["cuda:0", "cuda:1"]
    its = items(f"tp2-{path[:3]}", [2, 32])
    _, results = run_request(dep, "tp", its)
    assert [set(r["where"].values()) for r in results] == [{"cuda:0"}, {"cuda:1"}]
    for rank in dep.ranks:
        assert cg.planes(rank).get(PLANE[path], 0) > 0
    run_request(dep, "tp-slow", items(f"tp2s-{path[:3]}", [8]), sleep_cycles=SLEEP_CYCLES)
