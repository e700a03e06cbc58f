// Package gotests holds the cross-package tests: a producer, a sharded
// consumer and a consumer scheduler, opened by package node as production
// opens them, wired together in one process. Most run over real ZeroMQ
// sockets and a real data plane, with faults injected by closing any of
// them at the worst moment; the in-memory cluster (inmem_harness_test.go)
// runs the same objects over control.InmemNetwork and transport.Inmem, so
// that a test can cut, delay and heal any link mid-batch and check the
// invariants that must hold whatever happens.
package gotests
