"""Which connector hooks a vLLM calls, read from its source
(ecmooncake.connector.calls): trees shaped as vLLM 0.26 and 0.30 lay out
their call sites, without vLLM installed."""

from __future__ import annotations

from pathlib import Path

from ecmooncake.connector.calls import MIXIN, RUNNER_V2, SCHEDULER, WORKER, read_calls

# vLLM 0.26: the scheduler calls the KV connector's update_connector_output
# and has_pending_push_work, never the EC connector's; the EC connector is
# asked ensure_cache_available in the waiting path only.
SCHEDULER_026 = """
class Scheduler:
    def schedule(self):
        if self.ec_connector is not None and not self.ec_connector.ensure_cache_available(
            request, num_computed_tokens
        ):
            pass
        if self.ec_connector is not None and self.ec_connector.has_cache_item(h):
            pass
    def update_from_output(self, out):
        self.connector.update_connector_output(kv_connector_output)
    def has_work(self):
        return self.connector is not None and self.connector.has_pending_push_work()
    def update_connector_output(self, x):  # a definition is no call
        pass
"""
MIXIN_026 = """
def maybe_save_ec_to_connector(encoder_cache, mm_hash):
    connector = get_ec_transfer()
    connector.save_caches(encoder_cache=encoder_cache, mm_hash=mm_hash)
def _get_ec_connector_output(scheduler_output, encoder_cache):
    ec_connector.bind_connector_metadata(scheduler_output.ec_connector_metadata)
    ec_connector.start_load_caches(encoder_cache)
"""
WORKER_026 = "def init_device(self):\n    ensure_ec_transfer_initialized(self.vllm_config)\n"

SCHEDULER_030 = """
class Scheduler:
    def schedule(self):
        if not self.ec_connector.ensure_cache_available(request, n):
            pass
        if not self.ec_connector.ensure_cache_available(request, n):
            pass
    def update_from_output(self, out):
        error_req_ids.update(self.ec_connector.take_unavailable_requests())
        self.ec_connector.update_connector_output(ec_connector_output)
    def has_work(self):
        return self.ec_connector is not None and self.ec_connector.has_pending_push_work()
"""
MIXIN_030 = """
def _get_ec_connector_output(scheduler_output, encoder_cache):
    ec_connector.start_save_caches(encoder_cache=encoder_cache)
    output.ec_connector_worker_meta = ec_connector.build_connector_worker_meta()
"""
RUNNER_V2_030 = """
def maybe_get_output(self):
    ec_connector.start_save_caches(encoder_cache=self.encoder_cache)
    output.ec_connector_stats = ec_connector.get_ec_connector_stats()
    output.ec_connector_worker_meta = ec_connector.build_connector_worker_meta()
"""
WORKER_030 = "def load_model(self):\n    get_ec_transfer().start_worker_services()\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_vllm_026_calls_only_ensure_cache_available_and_in_the_waiting_path(tmp_path):
    calls = read_calls(tree(tmp_path, {SCHEDULER: SCHEDULER_026, MIXIN: MIXIN_026, WORKER: WORKER_026}))
    assert [name for name, called in calls.hooks.items() if called] == ["ensure_cache_available"]
    assert calls.ensure_paths == 1
    assert calls.outcomes is False
    assert calls.unread == []


def test_vllm_030_calls_every_hook_but_the_stats_of_the_v1_runner(tmp_path):
    calls = read_calls(tree(tmp_path, {SCHEDULER: SCHEDULER_030, MIXIN: MIXIN_030, RUNNER_V2: RUNNER_V2_030, WORKER: WORKER_030}))
    assert calls.outcomes is True
    assert calls.ensure_paths == 2
    missing = [name for name, called in calls.hooks.items() if not called]
    assert missing == ["get_ec_connector_stats"], "its scheduler does not ask for stats"


def test_a_worker_hook_one_runner_skips_counts_as_not_called(tmp_path):
    # vLLM 0.28 and 0.29: the V2 runner builds the worker report, the V1
    # runner (the one an EC instance uses there) does not.
    mixin = MIXIN_030.replace("output.ec_connector_worker_meta = ec_connector.build_connector_worker_meta()", "pass")
    calls = read_calls(tree(tmp_path, {SCHEDULER: SCHEDULER_030, MIXIN: mixin, RUNNER_V2: RUNNER_V2_030, WORKER: WORKER_030}))
    assert calls.hooks["build_connector_worker_meta"] is False
    assert calls.outcomes is False


def test_unreadable_source_falls_back_to_the_base_class(tmp_path):
    class Base:
        def take_unavailable_requests(self):
            pass

    calls = read_calls(tree(tmp_path, {MIXIN: MIXIN_030}), base=Base)
    assert SCHEDULER in calls.unread and WORKER in calls.unread
    assert calls.hooks["take_unavailable_requests"] is True, "the base class has it"
    assert calls.hooks["has_pending_push_work"] is False, "the base class lacks it"
    assert calls.hooks["start_save_caches"] is True, "read from the runner that exists"
