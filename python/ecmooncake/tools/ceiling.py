"""Ceilings for the benchmarks: the same work done without ecmooncake,
measured in the same run as the figure that is divided by it.

A ceiling is one only when it does the measured path's work with at least
the measured path's resources. So every benchmark takes its ceilings from
here, and:

- TCP is the data plane's own writer and receiver with no reservations
  around them (the ``ecm-ceiling`` command built beside the library), with
  the transfer's frame size and socket options, its sender and its
  receivers in separate processes (one receiver per consumer shard), each
  with the GOMAXPROCS of the measured workers, over as many connections as
  the transfer opens; a sample is the fastest of a few rounds over the same
  connections; the best over fewer connections is reported beside it;
- a copy ceiling copies with as many threads as the measured copy uses;
- each ceiling is sampled before and after the measured phase and the
  higher sample kept, so load that came and went during the run cannot
  lower it.

A ratio above :data:`RATIO_LIMIT` means the ceiling was not one, a bug in
the benchmark: :func:`mark` flags the summary and says so on stderr.

``python -m ecmooncake ceiling`` measures the TCP ceiling alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RATIO_LIMIT = 1.02
BEFORE, AFTER = "before", "after"
GB = 1e9
GiB = 1 << 30


class CeilingError(RuntimeError):
    """A ceiling could not be measured."""


@dataclass
class Ceiling:
    """The samples of one ceiling and what they were taken with.

    A variant is one way of doing the work (a number of TCP connections, a
    thread count); ``primary`` is the variant that matches the measured
    path, the one its ratio is taken against. The value of a variant is its
    highest sample.
    """

    name: str
    params: dict[str, Any]
    primary: Any
    # How the summary line words the parameters; "key value" when empty.
    phrases: list[str] = field(default_factory=list)
    variant_unit: str = ""
    samples: dict[Any, list[tuple[str, float]]] = field(default_factory=dict)

    def add(self, variant: Any, when: str, value: float) -> None:
        self.samples.setdefault(variant, []).append((when, float(value)))

    def value(self, variant: Any = None) -> float:
        """The highest sample of variant (default: the primary); 0 if none."""
        got = self.samples.get(self.primary if variant is None else variant) or []
        return max((v for _, v in got), default=0.0)

    def best(self) -> tuple[Any, float]:
        """The variant with the highest sample, and that sample."""
        if not self.samples:
            return self.primary, 0.0
        variant = max(self.samples, key=self.value)
        return variant, self.value(variant)

    def ratio(self, measured: float, variant: Any = None) -> float:
        cap = self.value(variant)
        return measured / cap if cap > 0 else 0.0

    def sample_count(self) -> int:
        """Samples per variant (the fewest any variant has)."""
        return min((len(v) for v in self.samples.values()), default=0)

    def as_dict(self) -> dict:
        best_variant, best = self.best()
        return {
            "name": self.name,
            "params": dict(self.params),
            "primary": self.primary,
            "gb_per_s": self.value() / GB,
            "best": best_variant,
            "best_gb_per_s": best / GB,
            "samples": self.sample_count(),
            "text": self.describe(),
            "by_variant_gb_per_s": {
                str(k): {"max": self.value(k) / GB, "samples": {w: v / GB for w, v in _by_when(s).items()}}
                for k, s in sorted(self.samples.items(), key=lambda kv: str(kv[0]))
            },
        }

    def whens(self) -> list[str]:
        """The labels of the primary variant's samples, in order."""
        return [w for w, _ in self.samples.get(self.primary) or []]

    def describe(self) -> str:
        """The value and every parameter, for a summary line."""
        params = ", ".join(self.phrases or [f"{k} {v}" for k, v in self.params.items()])
        whens = self.whens()
        line = (
            f"{self.name} {self.value() / GB:.2f} GB/s ({params}; "
            f"{len(whens)} samples: {', '.join(whens)}; the higher kept)"
        )
        if len(self.samples) > 1:
            best_variant, best = self.best()
            tried = ", ".join(str(k) for k in sorted(self.samples))
            line += f"; best of {tried} {self.variant_unit}: {best / GB:.2f} GB/s at {best_variant}"
        return line


def _by_when(samples: list[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for when, value in samples:
        out[when] = max(out.get(when, 0.0), value)
    return out


def size_text(nbytes: int) -> str:
    """1 GiB, 64 MiB, 4 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def over_limit(ratios: dict[str, float], limit: float = RATIO_LIMIT) -> list[str]:
    """A warning for each ratio above limit."""
    return [
        f"{name}: {ratio:.2f} of its ceiling, above {limit}: the ceiling is not one (a benchmark bug)"
        for name, ratio in ratios.items()
        if ratio > limit
    ]


def mark(summary: dict, ratios: dict[str, float], limit: float = RATIO_LIMIT, stream: Any = None) -> dict:
    """Flags summary when a ratio is above limit: ``ceiling_exceeded`` and
    ``ceiling_warnings`` in the JSON, and the warnings on stderr now."""
    warnings = over_limit(ratios, limit)
    summary["ceiling_exceeded"] = bool(warnings)
    summary["ceiling_warnings"] = warnings
    for w in warnings:
        print(f"WARNING: {w}", file=stream or sys.stderr, flush=True)
    return summary


def warning_lines(summary: dict) -> list[str]:
    """The lines a text summary prints for a flagged summary."""
    if not summary.get("ceiling_exceeded"):
        return []
    return ["  !!! CEILING EXCEEDED: these figures are not to be trusted"] + [
        f"  !!! {w}" for w in summary.get("ceiling_warnings", [])
    ]


# --- TCP across processes -----------------------------------------------------

# The command build/build_lib.py builds beside the library: one end of the
# TCP ceiling per process (core/transport/cmd/ecm-ceiling).
CEILING_COMMAND = "ecm-ceiling"
CEILING_ENV = "ECMOONCAKE_CEILING"
# The transfer's frame size unless tcp_chunk_bytes says otherwise (the
# library's default).
DEFAULT_CHUNK_BYTES = 8 << 20
# A TCP sample is the fastest of this many rounds over the same warm
# connections, each a share of the sample's bytes: on a loaded machine a
# single round can land on a burst of other work and read far below what
# the sockets do, even below the transfer beside it.
DEFAULT_ROUNDS = 4


def ceiling_command() -> Path:
    """The ecm-ceiling executable: $ECMOONCAKE_CEILING, else the one beside
    the library that would be loaded ($ECMOONCAKE_LIBRARY, then the package
    directory)."""
    from .. import _ffi

    paths = [Path(os.environ[CEILING_ENV])] if os.environ.get(CEILING_ENV) else []
    paths += [lib.parent / CEILING_COMMAND for lib in _ffi.candidates()]
    for path in paths:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise CeilingError(
        f"{CEILING_COMMAND} not found (tried {', '.join(map(str, paths))}); build it with "
        f"'python build/build_lib.py' (it is built beside {_ffi.LIBRARY_NAME}) or point {CEILING_ENV} at it"
    )


def stream_counts(conns: int, receivers: int = 1) -> list[int]:
    """The connection counts a TCP ceiling tries: receivers times each power
    of two up to conns, and conns itself."""
    if receivers < 1 or conns < receivers or conns % receivers:
        raise ValueError(f"{conns} connections cannot be spread evenly over {receivers} receivers")
    counts = {conns}
    k = receivers
    while k < conns:
        counts.add(k)
        k *= 2
    return sorted(counts)


class TCPCeiling:
    """The TCP data plane alone, from one sender process to ``receivers``
    receiver processes, each with GOMAXPROCS ``gomaxprocs``, over ``conns``
    connections in all (and the fewer ones of :func:`stream_counts`).

    It is the data plane's own writer and receiver (ecm-ceiling, see
    core/transport/tcp/ceiling.go) with the transfer's frame size
    (``chunk_bytes``, its ``tcp_chunk_bytes``) and socket options, and no
    reservations, no control plane and no Python around them: the work of
    the transfer's sockets and nothing else, so an upper bound on it. Its
    source is untouched memory (the kernel's zero page, the cheapest there
    is) and each receiver reads into reused regions touched beforehand.
    Like the workers, its processes are not pinned to CPUs. A sample of
    ``nbytes`` is ``rounds`` rounds of ``nbytes / rounds`` over the same
    connections, the fastest kept."""

    def __init__(
        self,
        gomaxprocs: int,
        conns: int,
        receivers: int = 1,
        nbytes: int = GiB,
        host: str = "127.0.0.1",
        timeout_s: float = 300,
        runner: Callable[..., list[float]] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        socket_buffer: int = 0,
        rounds: int = DEFAULT_ROUNDS,
    ):
        if rounds < 1 or nbytes < rounds * conns:
            raise ValueError(f"a TCP ceiling of {nbytes} bytes cannot be {rounds} rounds over {conns} connections")
        self.gomaxprocs, self.conns, self.receivers = gomaxprocs, conns, receivers
        self.nbytes, self.host, self.timeout_s = nbytes, host, timeout_s
        self.chunk_bytes, self.socket_buffer, self.rounds = chunk_bytes, socket_buffer, rounds
        self.variants = stream_counts(conns, receivers)
        self._runner = runner or run_tcp_rounds
        self.book = Ceiling(
            "TCP data plane alone",
            {
                "processes": 1 + receivers,
                "senders": 1,
                "receivers": receivers,
                "gomaxprocs": gomaxprocs,
                "connections": conns,
                "goroutines_per_connection": "1 sender + 1 ack reader; 1 receiver",
                "chunk_bytes": chunk_bytes,
                "socket_buffer": socket_buffer or "kernel autotuning",
                "cpu_affinity": "none (inherited, as the workers)",
                "source": "untouched memory (zero page)",
                "destination": "reused regions, touched beforehand",
                "bytes_per_sample": nbytes,
                "rounds_per_sample": rounds,
                "host": host,
            },
            primary=conns,
            phrases=[
                f"the data plane's own writer and receiver, {size_text(chunk_bytes)} frames, no reservations",
                f"1 sender + {receivers} receiver process{'es' if receivers > 1 else ''}",
                f"GOMAXPROCS {gomaxprocs} each",
                f"{conns} connections" + (f" ({conns // receivers} per receiver)" if receivers > 1 else ""),
                "socket buffers " + (size_text(socket_buffer) if socket_buffer else "autotuned"),
                "no CPU pinning",
                f"{size_text(nbytes)} per sample"
                + (f" (the fastest of {rounds} rounds of {size_text(nbytes // rounds)})" if rounds > 1 else ""),
                f"on {host}",
            ],
            variant_unit="connections",
        )

    def measure(self, when: str) -> None:
        """One sample of every variant, labelled when (BEFORE or AFTER)."""
        rates = self._runner(
            gomaxprocs=self.gomaxprocs,
            receivers=self.receivers,
            schedule=[s // self.receivers for s in self.variants],
            nbytes=self.nbytes // self.rounds,
            rounds=self.rounds,
            host=self.host,
            timeout_s=self.timeout_s,
            chunk_bytes=self.chunk_bytes,
            socket_buffer=self.socket_buffer,
        )
        for streams, rate in zip(self.variants, rates, strict=True):
            self.book.add(streams, when, rate)


def run_tcp_rounds(
    gomaxprocs: int,
    receivers: int,
    schedule: list[int],
    nbytes: int,
    host: str = "127.0.0.1",
    timeout_s: float = 300,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    socket_buffer: int = 0,
    rounds: int = 1,
) -> list[float]:
    """Starts the receiver and sender processes (ecm-ceiling) and measures
    each entry of schedule (connections per receiver): ``rounds`` rounds of
    nbytes; returns the fastest round's bytes/s of each. Every byte the
    sender sent must have landed on a receiver."""
    exe = str(ceiling_command())
    common = ["-gomaxprocs", str(gomaxprocs), "-chunk-bytes", str(chunk_bytes), "-socket-buffer", str(socket_buffer)]
    procs: list[subprocess.Popen] = []
    # A process that hangs is killed at the deadline, which ends every
    # read below with EOF.
    budget = timeout_s * (len(schedule) * rounds + 1)
    killer = threading.Timer(budget, lambda: [p.kill() for p in procs if p.poll() is None])
    killer.daemon = True
    killer.start()
    try:
        addrs = []
        for _ in range(receivers):
            p = subprocess.Popen(
                [exe, "recv", "-listen", f"{host}:0", "-regions", str(max(schedule)), *common],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            procs.append(p)
            line = p.stdout.readline()
            try:
                addrs.append(json.loads(line)["addr"])
            except (ValueError, KeyError) as exc:
                raise CeilingError(f"TCP ceiling receiver gave no address: {_tail(p, line)}") from exc
        sender = subprocess.Popen(
            [exe, "send", "-to", ",".join(addrs), "-schedule", ",".join(map(str, schedule)),
             "-bytes", str(nbytes), "-rounds", str(rounds), "-timeout", str(timeout_s), *common],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        procs.append(sender)
        out, err = sender.communicate()
        landed = 0
        for p in procs[:-1]:
            p.stdin.close()
            line = p.stdout.readline()
            p.wait()
            if p.returncode == 0:
                landed += int(json.loads(line)["bytes"])
        bad = [p for p in procs[:-1] if p.returncode != 0]
        if bad or sender.returncode != 0:
            raise CeilingError(
                "TCP ceiling: " + "; ".join(_tail(p, "") for p in bad) + (f"; sender (exit {sender.returncode}): {err.strip()[-2000:]}")
            )
        report = json.loads(out.strip().splitlines()[-1])
        rates = report["bytes_per_sec"]
        if len(rates) != len(schedule):
            raise CeilingError(f"TCP ceiling: {len(rates)} rounds reported, {len(schedule)} run")
        if report["params"]["gomaxprocs"] != gomaxprocs:
            raise CeilingError(f"TCP ceiling: the sender ran with GOMAXPROCS {report['params']['gomaxprocs']}, not {gomaxprocs}")
        if landed != report["bytes_sent"]:
            raise CeilingError(f"TCP ceiling: {report['bytes_sent']} bytes sent but {landed} landed")
        return [float(r) for r in rates]
    finally:
        killer.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()


def _tail(p: subprocess.Popen, line: str) -> str:
    try:
        err = p.stderr.read() if p.stderr and p.poll() is not None else ""
    except (OSError, ValueError):
        err = ""
    return f"{' '.join(p.args[:2])} (exit {p.returncode}): {(line + err).strip()[-2000:]}"


# --- copies ------------------------------------------------------------------


def torch_copy_ceiling(nbytes: int, threads: int, iters: int = 5) -> float:
    """Host-memory copy of nbytes between two fresh tensors with PyTorch,
    on ``threads`` threads, bytes/s (the fastest of iters copies). The
    thread count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        fastest = float("inf")
        for _ in range(iters):
            started = time.perf_counter()
            dst.copy_(src)
            fastest = min(fastest, time.perf_counter() - started)
        return nbytes / fastest
    finally:
        torch.set_num_threads(before)


COPY_SAMPLE_BYTES = 512 << 20


class HostCopyCeiling:
    """The shm plane's work without the plane: ``count`` items of ``nbytes``
    copied by the plane's own copy (``ecm-ceiling copy``, see
    core/transport/shm/ceiling.go: each item split over up to GOMAXPROCS
    goroutines, as the producer's) from one untouched source (the zero
    page, as the benchmark's producer hands over slices of one untouched
    buffer) into distinct destinations touched beforehand, in a process
    with the workers' GOMAXPROCS. A sample is the fastest of ``rounds``
    rounds of the whole batch (by default enough to move
    :data:`COPY_SAMPLE_BYTES`, within 5..20: on a loaded machine a few
    rounds can all land on other work, and the sample would then read below
    the plane it bounds)."""

    def __init__(self, nbytes: int, count: int, gomaxprocs: int, rounds: int = 0, timeout_s: float = 300):
        if nbytes < 1 or count < 1 or gomaxprocs < 1 or rounds < 0:
            raise ValueError(f"a copy ceiling needs positive sizes: {nbytes} bytes x {count}, GOMAXPROCS {gomaxprocs}, {rounds} rounds")
        self.nbytes, self.count, self.gomaxprocs, self.timeout_s = nbytes, count, gomaxprocs, timeout_s
        self.rounds = rounds or max(5, min(20, COPY_SAMPLE_BYTES // (nbytes * count)))
        self.book = Ceiling(
            "host copy",
            {"item_bytes": nbytes, "items": count, "gomaxprocs": gomaxprocs, "rounds_per_sample": self.rounds,
             "source": "untouched memory (zero page)", "destination": "distinct regions, touched beforehand"},
            primary=gomaxprocs,
            phrases=[
                f"the shm plane's own copy of {count} x {size_text(nbytes)} from untouched into touched memory",
                f"GOMAXPROCS {gomaxprocs}",
                f"the fastest of {self.rounds} rounds",
            ],
            variant_unit="GOMAXPROCS",
        )

    def measure(self, when: str) -> None:
        self.book.add(self.gomaxprocs, when, host_copy_rate(self.nbytes, self.count, self.gomaxprocs, self.rounds, self.timeout_s))


def host_copy_rate(nbytes: int, count: int, gomaxprocs: int, rounds: int, timeout_s: float = 300) -> float:
    """Bytes/s of :class:`HostCopyCeiling`'s batch copy, the fastest of rounds."""
    args = [str(ceiling_command()), "copy", "-item-bytes", str(nbytes), "-count", str(count), "-rounds", str(rounds),
            "-gomaxprocs", str(gomaxprocs)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CeilingError(f"copy ceiling: no answer within {timeout_s:.0f}s") from exc
    if done.returncode != 0:
        raise CeilingError(f"copy ceiling (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["params"]["gomaxprocs"] != gomaxprocs:
        raise CeilingError(f"copy ceiling: ran with GOMAXPROCS {report['params']['gomaxprocs']}, not {gomaxprocs}")
    return float(report["bytes_per_sec"])


# --- command line --------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conns", type=int, default=4, help="connections in all, as the transfer opens (default %(default)s)")
    parser.add_argument("--receivers", type=int, default=1, help="receiver processes, as consumer shards (default %(default)s)")
    parser.add_argument("--gomaxprocs", type=int, default=2, help="GOMAXPROCS of each process (default %(default)s)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="frame size, the transfer's tcp_chunk_bytes (default %(default)s)")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB per sample (default %(default)s)")
    parser.add_argument("--samples", type=int, default=2, help="samples of each connection count (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds per sample, the fastest kept (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address the receivers listen on (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per round (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    try:
        tcp = TCPCeiling(args.gomaxprocs, args.conns, args.receivers, int(args.gib * GiB), args.host, args.timeout,
                         chunk_bytes=args.chunk_bytes, rounds=args.rounds)
        for i in range(args.samples):
            tcp.measure(f"sample {i + 1}")
    except (CeilingError, ValueError, OSError) as exc:
        print(f"ecmooncake ceiling: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(tcp.book.as_dict(), indent=2, sort_keys=True))
    else:
        print(f"ceiling: {tcp.book.describe()}")
        for k in tcp.variants:
            print(f"  {k:>3} connections  {tcp.book.value(k) / GB:6.2f} GB/s")
    return 0
