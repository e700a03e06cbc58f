// Package node assembles the process objects of a deployment from their
// settings: a consumer shard (over a host or a GPU receive slab), a
// producer and a consumer scheduler. It is the one place that decides the
// wiring; the C boundary (package capi) only decodes arguments and calls
// in here, and the cross-package tests build their clusters through it, so
// what they test is what production runs.
//
// What it owns:
//   - the data plane of each object, per peer: the network transport the
//     settings name (tcp, mooncake, shm); for a GPU slab or GPU sources, TCP
//     staged through page-locked memory (package staged); beside it a
//     same-host plane (cuda_ipc) through a route that picks one per shard
//     (package route) from host identity (ids.HostIdentity),
//     local_transport and transport_overrides; the Mooncake engine, which
//     both roles build, in mooncake.go, so producer-side files never import
//     core/consumer (layout_test.go checks it);
//   - which GPUs the process has (the CUDA driver, opened on first use,
//     or Options.Devices), and recording the readiness event of each
//     stream that GPU sources come from;
//   - the Mooncake metadata store a consumer asks to serve, closed with
//     the shard;
//   - the process's one /metrics server (ServeMetrics; a Metrics of its
//     own for a test).
//
// Usage:
//
//	cfg, _ := config.DecodeConsumer(raw)
//	shard, err := node.OpenConsumer(cfg, slab, node.Options{})
//	defer shard.Close()
//
//	prod, err := node.OpenProducer(pcfg, node.Options{})
//	prod.Submit(pushes)
//	prod.SourcesDevice(outputs) // host or GPU memory
//
//	sched, err := node.OpenScheduler(scfg, node.Options{})
//
// The zero Options is production. A test replaces what it must: Devices
// with a gpu.FakeHost, Network with a fault-injecting data plane (the
// transport.Inmem fake), Control with control-plane links of its own (the
// control.InmemNetwork fake); the node wraps a replaced network transport
// exactly as it wraps its own.
//
// Errors that mean "this process cannot do that" (a transport not in this
// build, a missing TransferEngine library, no GPU) wrap ErrUnavailable;
// arguments that cannot be right wrap config.ErrInvalid.
package node
