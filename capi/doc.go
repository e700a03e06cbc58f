// Package capi is the boundary between the C ABI (package main in
// export/) and the core: handles, status codes with error text, settings
// decoding and panic recovery. It decides no wiring: each open call decodes
// its settings and hands them to package node, which assembles the object.
// It is plain Go with no cgo, so everything the ABI does can be tested with
// go test.
//
// Handles are our own table of uint64 ids rather than runtime/cgo.Handle:
// cgo.Handle panics on an unknown or deleted value, while a Python caller
// that closes an object twice, or passes a producer handle to a consumer
// call, must get ECM_ERR_HANDLE with a message. Ids are never reused, so a
// stale handle can never reach a newer object.
//
// Every entry point runs under Guard, which turns a panic into
// StatusInternal: a Go panic must never abort the Python process.
//
// A call from a child forked after the library was loaded never reaches
// this package: the C side of each export (export/gate.c) refuses it
// before the Go runtime is entered. Before any work every export checks
// its pointers (NotNil), item counts (Count, at most MaxSources) and
// (pointer, nbytes) pairs (Span). A recovered panic is too late for those: a NULL out
// parameter would leave an opened object nobody can close, and a lying
// count aborts the process with an allocation the runtime cannot make.
package capi
