// Package fsm holds, one package each, the deterministic state machines of
// ecmooncake: slab (the receive slab's lifecycle and allocator), reserve (a
// shard's reservation table), sched (the scheduler-side transfer table) and
// push (the producer's push table).
//
// None of them does I/O, starts a goroutine or reads a clock: time comes in
// as an argument and every effect goes out as a returned value. The runtimes
// that drive them from sockets and goroutines live beside this folder:
// core/consumer drives slab and reserve, core/scheduler drives sched and
// core/producer drives push.
//
// What the four share lives in core/internal: machine (the sentinel errors
// for the refusals they have in common, re-exported under each package's
// own names, and Edges, the one check of a state move against a table of
// legal edges), invariant (the report CheckInvariants builds) and, for
// their tests, fsmtest.
package fsm
