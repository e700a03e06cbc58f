// Package core is the whole connector in plain Go; this file maps its
// packages onto one request's journey (docs/design.md follows one request
// and one byte of it, from save_caches to encoder_cache).
//
//   - proxy mints a transfer_id per image and sends it to an encoder;
//     discovery keeps instances registered at the proxies.
//   - producer (the encoder's worker) reserves room on every consumer
//     shard before the encoder runs, writes the output there and sends one
//     complete per shard; consumer (each TP shard of the prefill/decode
//     instance) serves those reservations and announces what is ready;
//     scheduler (that instance's engine core) learns from the events that
//     every shard holds an item, and answers vLLM's hooks without I/O.
//   - fsm/{slab,reserve,sched,push} are the I/O-free state machines those
//     three runtimes drive: the receive slab, a shard's reservations, the
//     scheduler's transfers, the producer's pushes. Each hands its effects
//     out as one value from Ready (fsm's doc states the protocol).
//   - node assembles a shard, a producer or a scheduler from its settings
//     (config): data planes per peer, staging, routes, metadata, metrics.
//   - control (ZeroMQ sockets) and wire (messages and codec) are the
//     control plane; transport holds what every data plane shares (the
//     interfaces, errors, stats, the in-memory fake) and each plane has a
//     folder of its own below it (tcp, shm, cudaipc, mooncake), with
//     staged and route composing them; cuda and gpu are the GPUs.
//   - trace stamps each hop of an item's ready path with CLOCK_MONOTONIC
//     into a bounded ring per process, off unless asked for.
//   - metadata serves Mooncake's metadata store, metrics the counters;
//     ids are the identities and tokens that every plane checks, and the
//     host identity both roles compare to pick a same-host plane.
//
// The C ABI (capi, export) and the Python package sit on top of node.
package core
