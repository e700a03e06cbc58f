"""Command line: ``python -m ecmooncake demo`` and ``python -m ecmooncake bench``."""

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
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    bench = commands.add_parser(
        "bench",
        help="measure host-memory transfer over loopback against the raw TCP ceiling",
        description="Pushes batches of large and small items from a producer process to a "
        "consumer process and reports throughput as a ratio to Go's raw TCP loopback, "
        "measured in the same run.",
    )
    bench.add_argument("--mb", type=float, default=32, help="large item size, MiB (default %(default)s)")
    bench.add_argument("--batch", type=int, default=8, help="large items per batch (default %(default)s)")
    bench.add_argument("--batches", type=int, default=16, help="timed large batches (default %(default)s)")
    bench.add_argument("--small-kb", type=float, default=64, help="small item size, KiB (default %(default)s)")
    bench.add_argument("--small-batch", type=int, default=256, help="small items per batch (default %(default)s)")
    bench.add_argument("--small-batches", type=int, default=8, help="timed small batches (default %(default)s)")
    bench.add_argument("--json", action="store_true", help="print the summary as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(args)
    from . import bench

    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
