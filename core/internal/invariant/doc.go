// Package invariant collects what a state machine's CheckInvariants finds:
// every violation, not only the first, so that one failing step of a test
// shows all that went wrong at once.
package invariant
