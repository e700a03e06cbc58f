"""Command line: ``python -m ecmooncake demo``, ``bench``, ``proxy`` and the other tools."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecmooncake",
        description="Encoder-cache transport for disaggregated multimodal serving.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="move synthetic encoder outputs from a producer to a two-shard consumer and verify them",
        description="Starts a two-shard consumer and a producer as separate processes on "
        "loopback, with the consumer scheduler in this process; pushes synthetic encoder "
        "outputs, verifies every byte on every shard and prints a summary. Exits 1 if any "
        "item failed or differs.",
    )
    demo.add_argument("--items", type=int, default=48, help="number of items (default %(default)s)")
    demo.add_argument("--min-mb", type=float, default=1.0, help="smallest item, MiB (default %(default)s)")
    demo.add_argument("--max-mb", type=float, default=64.0, help="largest item, MiB (default %(default)s)")
    demo.add_argument(
        "--dup-ratio",
        type=float,
        default=0.15,
        help="share of items that repeat an earlier item's mm_hash (default %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=1, help="seed of sizes and contents (default %(default)s)")
    demo.add_argument("--slab-mb", type=float, default=None, help="receive slab per shard, MiB (default: sized from --max-mb)")
    demo.add_argument("--timeout", type=float, default=None, help="seconds allowed per window of items (default: from its size)")
    demo.add_argument("--gomaxprocs", type=int, default=2, help="GOMAXPROCS of every process, the ceiling's too (default %(default)s)")
    demo.add_argument("--tcp-conns", type=int, default=4, help="producer connections to each shard, the ceiling's too (default %(default)s)")
    demo.add_argument("--ceiling-mb", type=float, default=1024, help="MiB per ceiling sample (default %(default)s)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    bench = commands.add_parser(
        "bench",
        help="measure host-memory transfer over loopback against the TCP ceiling",
        description="Pushes batches of large and small items from a producer process to a "
        "consumer process and reports throughput as a ratio to the TCP data plane alone over loopback, "
        "measured in the same run.",
    )
    bench.add_argument("--mb", type=float, default=32, help="large item size, MiB (default %(default)s)")
    bench.add_argument("--batch", type=int, default=8, help="large items per batch (default %(default)s)")
    bench.add_argument("--batches", type=int, default=16, help="timed large batches (default %(default)s)")
    bench.add_argument("--small-kb", type=float, default=64, help="small item size, KiB (default %(default)s)")
    bench.add_argument("--small-batch", type=int, default=256, help="small items per batch (default %(default)s)")
    bench.add_argument("--small-batches", type=int, default=8, help="timed small batches (default %(default)s)")
    bench.add_argument("--gomaxprocs", type=int, default=2, help="GOMAXPROCS of every process, the ceiling's too (default %(default)s)")
    bench.add_argument("--tcp-conns", type=int, default=4, help="producer connections to the shard, the ceiling's too (default %(default)s)")
    bench.add_argument("--ceiling-mb", type=float, default=1024, help="MiB per ceiling sample (default %(default)s)")
    bench.add_argument("--json", action="store_true", help="print the summary as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw throughput against item size, with the ceilings, into this PNG (needs matplotlib)")

    from . import ceiling as _ceiling  # argument table only; loads no library

    _ceiling.add_arguments(
        commands.add_parser(
            "ceiling",
            help="measure the TCP ceiling the benchmarks divide by",
            description="The TCP data plane alone (its own writer and receiver, no reservations; "
            "the ecm-ceiling command) from a sender process to receiver processes, each with "
            "its own GOMAXPROCS, over 1 to --conns connections, as the benchmarks measure it "
            "before and after their timed phases.",
        )
    )

    from . import bench_vllm as _bench_vllm  # argument table only; imports no vLLM

    _bench_vllm.add_arguments(
        commands.add_parser(
            "bench-vllm",
            help="time vLLM's ECExampleConnector against ECMooncakeConnector through the same hooks",
            description="Drives vLLM's ECExampleConnector (a shared directory on /dev/shm) and "
            "ECMooncakeConnector through the same hook sequence, in an encoder and a PD process, "
            "and prints the time from save_caches to the tensor in the PD worker's encoder cache "
            "for each item size, their ratio, and the ceilings measured in the same run. "
            "Needs vLLM and torch.",
        )
    )

    from . import bench_hooks as _bench_hooks  # argument table only; imports no vLLM

    _bench_hooks.add_arguments(
        commands.add_parser(
            "bench-hooks",
            help="time the consumer's scheduler hooks inside vLLM's own Scheduler",
            description="Drives vLLM's real Scheduler with ECMooncakeConnector as a consumer while a "
            "producer process pushes the requests' encoder outputs, and prints p50/p99 of "
            "has_cache_item and ensure_cache_available beside vLLM's own "
            "EncoderCacheManager.check_and_update_cache, timed in the same run. Needs vLLM and torch.",
        )
    )

    from . import gpubench as _gpubench  # argument table only; imports no torch

    _gpubench.add_arguments(
        commands.add_parser(
            "gpubench",
            help="GPU memory end to end: cuda_ipc and TCP against ceilings measured in the same run",
            description=_gpubench.__doc__.splitlines()[0] + " Needs a GPU and torch.",
        )
    )

    from . import proxy as _proxy  # argument tables only; loads no library

    _proxy.add_proxy_arguments(
        commands.add_parser(
            "proxy",
            help="run the EPD proxy in front of encoder and prefill/decode instances",
            description="OpenAI-compatible front: sends each media item to an encoder with the "
            "consumer to push to, rewrites the request for the consumer, streams its answer back. "
            "Runs until SIGINT or SIGTERM.",
        )
    )
    _proxy.add_register_arguments(
        commands.add_parser(
            "register",
            help="keep an instance registered with EPD proxies (a sidecar next to vllm serve)",
            description="Registers the instance with each proxy and keeps a heartbeat until "
            "SIGINT or SIGTERM, then deregisters it.",
        )
    )
    from . import metadata_server as _metadata_server  # argument table only; loads no library

    _metadata_server.add_arguments(
        commands.add_parser(
            "metadata-server",
            help="serve a Mooncake-compatible metadata store (GET/PUT/DELETE /metadata?key=K)",
            description="Serves the HTTP metadata protocol of Mooncake TransferEngine, for engines "
            "started with mooncake_metadata 'http://HOST:PORT/metadata', until SIGINT or SIGTERM. "
            "Prints its URL as the first line of stdout.",
        )
    )
    from . import doctor as _doctor  # argument table only; loads no library

    _doctor.add_arguments(
        commands.add_parser(
            "doctor",
            help="check that this host can serve the connector: library, libzmq, GPU, Mooncake, /dev/shm, ports, vLLM",
            description="One line per check (ok, warn or fail, with the fix); exits 1 if any check fails. "
            "With --ec-transfer-config, what that config asks for must be there; without, a GPU and "
            "Mooncake are optional and only warned about.",
        )
    )
    from .tools import tiny_model as _tiny_model  # argument table only; imports no torch

    _tiny_model.add_arguments(
        commands.add_parser(
            "tiny-model",
            help="write a tiny Qwen2-VL checkpoint with random weights (for trying EPD on a CPU)",
            description="Builds a complete Qwen2-VL checkpoint locally: random float32 weights "
            "(LM hidden size 128, 2 layers; a 2-block vision tower), a tokenizer trained here, "
            "the chat template and the processor configs. Nothing is downloaded. Needs torch, "
            "transformers and tokenizers (a vLLM environment has them).",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "metadata-server":
        from . import metadata_server

        return metadata_server.main(args)
    if args.command == "tiny-model":
        from .tools import tiny_model

        return tiny_model.main(args)
    if args.command == "doctor":
        from . import doctor

        return doctor.main(args)
    if args.command == "demo":
        from . import demo

        return demo.main(args)
    if args.command == "ceiling":
        from . import ceiling

        return ceiling.main(args)
    if args.command == "bench-hooks":
        from . import bench_hooks

        return bench_hooks.main(args)
    if args.command == "bench-vllm":
        from . import bench_vllm

        return bench_vllm.main(args, (sys.argv[1:] if argv is None else argv)[1:])
    if args.command == "gpubench":
        from . import gpubench

        return gpubench.run_args(args)
    if args.command in ("proxy", "register"):
        from . import proxy

        return proxy.proxy_main(args) if args.command == "proxy" else proxy.register_main(args)
    from . import bench

    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
