// Package machine holds what the core's state machines (slab, reserve,
// sched, push) share: the sentinel errors for the refusals they have in
// common, and the one check of a state move against a table of legal
// edges. Each machine re-exports the sentinels it returns under its own
// name, so errors.Is(err, push.ErrInvalid) and errors.Is(err,
// machine.ErrInvalid) hold alike.
package machine
