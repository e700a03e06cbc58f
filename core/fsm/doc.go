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
// # One effect protocol
//
// reserve, sched and push (slab has no effects: reserve is its one user)
// hand their effects out one way, after etcd raft's Ready. A call answers its caller directly (a grant, an offset, a
// load's transfer_id, an error); what the runtime must do for others (send
// reservations, writes and cancels, publish events, fail requests, free
// sources) is collected inside the machine until its Ready, which returns
// all of it as one value of the package's Effects type, with an Empty
// method:
//
//	rd := m.Ready(now) // reserve's Ready() takes no time: its deadlines fire only in Tick
//	if !rd.Empty() { apply(rd) }
//
// Taking a Ready acknowledges it: there is no Advance. Each effect appears
// in exactly one Ready, and a second Ready returns only what arose since.
// Raft needs Advance because its runtime must persist entries before the
// machine may go on; these machines have nothing to persist, and the
// outcome of each effect that can fail comes back as a call of its own
// (push's Granted, WriteDone, CompleteDone, CancelDone), which is the
// acknowledgement that matters. A runtime that cannot perform an effect
// reports that outcome rather than handing the effect back. Ready applies
// the deadlines due at now first (push, sched); Tick applies them alone,
// and what they caused waits for the next Ready. The drivers read alike:
// core/producer applyLocked(mgr.Ready(now)), core/consumer
// sendEventsLocked over table.Ready(), core/scheduler
// applyLocked(table.Ready(now)).
//
// What the four share lives in core/internal: machine (the sentinel errors
// for the refusals they have in common, re-exported under each package's
// own names, and Edges, the one check of a state move against a table of
// legal edges), invariant (the report CheckInvariants builds) and, for
// their tests, fsmtest.
package fsm
