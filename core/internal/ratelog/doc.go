// Package ratelog admits one log line per reason per interval, for refusals
// that a peer can cause as often as it likes (a scanner hammering an
// endpoint must not flood the log); counters keep the exact numbers.
package ratelog
