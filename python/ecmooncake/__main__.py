"""Command line: ``python -m ecmooncake demo``, ``bench``, ``proxy`` and the other tools.

Each command is a module with ``add_arguments(parser)`` and ``main(args)``
(the names differ only where one module serves two commands). Building the
parser imports every command's module for its argument table; none of them
loads the library, vLLM or torch before its ``main`` runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    help: str
    description: str
    add: str = "add_arguments"
    main: str = "main"


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "ecmooncake.tools.demo",
        "move synthetic encoder outputs from a producer to a two-shard consumer and verify them",
        "Starts a two-shard consumer and a producer as separate processes on loopback, with the consumer "
        "scheduler in this process; pushes synthetic encoder outputs, verifies every byte on every shard and "
        "prints a summary. Exits 1 if any item failed or differs.",
    ),
    "bench": Command(
        "ecmooncake.tools.bench",
        "measure host-memory transfer over loopback against the TCP ceiling",
        "Pushes batches of large and small items from a producer process to a consumer process and reports "
        "throughput as a ratio to the TCP data plane alone over loopback, measured in the same run. With --sweep "
        "(or --plot) it measures throughput and latency against item size, 64 KiB to 256 MiB, for the tcp and shm "
        "planes, each beside its ceiling.",
    ),
    "ceiling": Command(
        "ecmooncake.tools.ceiling",
        "measure the TCP ceiling the benchmarks divide by",
        "The TCP data plane alone (its own writer and receiver, no reservations; the ecm-ceiling command) from a "
        "sender process to receiver processes, each with its own GOMAXPROCS, over 1 to --conns connections, as "
        "the benchmarks measure it before and after their timed phases.",
    ),
    "bench-vllm": Command(
        "ecmooncake.tools.bench_vllm",
        "time vLLM's ECExampleConnector against ECMooncakeConnector through the same hooks",
        "Drives vLLM's ECExampleConnector (a shared directory on /dev/shm) and ECMooncakeConnector through the "
        "same hook sequence, in an encoder and a PD process, and prints the time from save_caches to the tensor "
        "in the PD worker's encoder cache for each item size, their ratio, and the ceilings measured in the same "
        "run. Needs vLLM and torch.",
    ),
    "bench-hooks": Command(
        "ecmooncake.tools.bench_hooks",
        "time the consumer's scheduler hooks inside vLLM's own Scheduler",
        "Drives vLLM's real Scheduler with ECMooncakeConnector as a consumer while a producer process pushes the "
        "requests' encoder outputs, and prints p50/p99 of has_cache_item and ensure_cache_available beside "
        "vLLM's own EncoderCacheManager.check_and_update_cache, timed in the same run. Needs vLLM and torch.",
    ),
    "hotpath": Command(
        "ecmooncake.tools.hotpath",
        "time Python's per-batch producer calls (submit, hand_over) against one crossing into the library",
        "A producer in this process pushes batches over loopback TCP to a consumer process; prints p50/p99 of "
        "Producer.submit and Producer.sources per batch beside a no-op native call timed in the same loop.",
    ),
    "gpubench": Command(
        "ecmooncake.tools.gpubench",
        "GPU memory end to end: cuda_ipc and TCP against ceilings measured in the same run",
        "GPU memory end to end: one consumer shard with its slab on a GPU, a producer choosing cuda_ipc and one "
        "told to use TCP, each figure beside the ceilings measured in the same run. Needs a GPU and torch.",
    ),
    "bench-serve": Command(
        "ecmooncake.tools.bench_serve",
        "an EPD fleet on this host under vllm bench serve, beside one instance and vLLM's ECExampleConnector",
        "Starts one fleet (the largest topology's encoders and PD instances, a tiny random Qwen2-VL on the CPU unless "
        "--model names one, and the --baselines) and runs every topology on it with a proxy of its own, driven by vllm "
        "bench serve --dataset-name random-mm at the given rates; prints one table per phase: vLLM's client figures "
        "beside items encoded and fallen back (the proxy), bytes moved and the PD scheduler's wait (the PD instances). "
        "--fault idle-pause, proxy-stop and kill-encoder add scenarios whose outcomes are checked.",
    ),
    "proxy": Command(
        "ecmooncake.tools.proxy",
        "run the EPD proxy in front of encoder and prefill/decode instances",
        "OpenAI-compatible front: sends each media item to an encoder with the consumer to push to, rewrites the "
        "request for the consumer, streams its answer back. Runs until SIGINT or SIGTERM.",
        add="add_proxy_arguments",
        main="proxy_main",
    ),
    "register": Command(
        "ecmooncake.tools.proxy",
        "keep an instance registered with EPD proxies (a sidecar next to vllm serve)",
        "Registers the instance with each proxy and keeps a heartbeat until SIGINT or SIGTERM, then deregisters it.",
        add="add_register_arguments",
        main="register_main",
    ),
    "metadata-server": Command(
        "ecmooncake.tools.metadata_server",
        "serve a Mooncake-compatible metadata store (GET/PUT/DELETE /metadata?key=K)",
        "Serves the HTTP metadata protocol of Mooncake TransferEngine, for engines started with mooncake_metadata "
        "'http://HOST:PORT/metadata', until SIGINT or SIGTERM. Prints its URL as the first line of stdout.",
    ),
    "doctor": Command(
        "ecmooncake.tools.doctor",
        "check that this host can serve the connector: library, libzmq, GPU, Mooncake, /dev/shm, ports, vLLM",
        "One line per check (ok, warn or fail, with the fix); exits 1 if any check fails. With "
        "--ec-transfer-config, what that config asks for must be there; without, a GPU and Mooncake are "
        "optional and only warned about.",
    ),
    "tiny-model": Command(
        "ecmooncake.tools.tiny_model",
        "write a tiny Qwen2-VL checkpoint with random weights (for trying EPD on a CPU)",
        "Builds a complete Qwen2-VL checkpoint locally: random float32 weights (LM hidden size 128, 2 layers; a "
        "2-block vision tower), a tokenizer trained here, the chat template and the processor configs. Nothing "
        "is downloaded. Needs torch, transformers and tokenizers (a vLLM environment has them).",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecmooncake",
        description="Encoder-cache transport for disaggregated multimodal serving.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        getattr(module, command.add)(commands.add_parser(name, help=command.help, description=command.description))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    # The command's own arguments, for a command that starts itself again.
    args.argv = argv[1:]
    command = COMMANDS[args.command]
    return getattr(importlib.import_module(command.module), command.main)(args)


if __name__ == "__main__":
    sys.exit(main())
