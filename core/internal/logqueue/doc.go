// Package logqueue writes an object's log records on a goroutine of its
// own, so that logging under a lock that a call holding the caller's GIL
// takes never waits on a stuck writer (a stderr pipe no one drains).
// Records past a bound are dropped and counted, never waited for.
package logqueue
