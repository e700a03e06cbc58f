// Package gotests holds the cross-package tests: a producer, a sharded
// consumer and a consumer scheduler wired together in one process over
// real ZeroMQ sockets and a real data plane, with faults injected by
// closing any of them at the worst moment.
package gotests
