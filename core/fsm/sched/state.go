package sched

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/internal/enum"
)

// State is where one transfer stands in the consumer scheduler. Each
// constant lists the states it may move to; transition is the only place
// that enforces them.
type State uint8

const (
	// WaitingEvent: a request expects the transfer and not every shard has
	// reported the bytes ready. → Available | Unavailable | Cancelled.
	WaitingEvent State = iota
	// Available: every shard holds the bytes; nothing loaded them yet.
	// → Loading | Expired | Cancelled.
	Available
	// Loading: a worker load was handed out for this step.
	// → Ready | Failed | Unavailable (deadline) | Cancelled.
	Loading
	// Ready: the engine's encoder cache holds a view of the bytes.
	// → Resident | Expired.
	Ready
	// Resident: the engine freed its entry; the bytes stay in the slab and
	// can be loaded again. → Loading | Expired.
	Resident
	// Unavailable (terminal): the push failed or did not arrive in time.
	Unavailable
	// Cancelled (terminal): no request wants the transfer any more.
	Cancelled
	// Expired (terminal): the bytes outlived their time-to-live or were
	// evicted from a shard's slab.
	Expired
	// Failed (terminal): a worker could not load the bytes.
	Failed

	numStates
)

var stateNames = [numStates]string{
	WaitingEvent: "WaitingEvent",
	Available:    "Available",
	Loading:      "Loading",
	Ready:        "Ready",
	Resident:     "Resident",
	Unavailable:  "Unavailable",
	Cancelled:    "Cancelled",
	Expired:      "Expired",
	Failed:       "Failed",
}

func (s State) String() string { return enum.Name("State", stateNames[:], s) }

// Terminal reports whether s ends a transfer: its record becomes a
// tombstone and no event can revive it.
func (s State) Terminal() bool {
	switch s {
	case Unavailable, Cancelled, Expired, Failed:
		return true
	}
	return false
}

// usable reports whether the bytes of a transfer in s are on every shard,
// so vLLM may load them instead of running its encoder.
func (s State) usable() bool {
	switch s {
	case Available, Loading, Ready, Resident:
		return true
	}
	return false
}

var legal = [numStates][numStates]bool{
	WaitingEvent: {Available: true, Unavailable: true, Cancelled: true},
	Available:    {Loading: true, Expired: true, Cancelled: true},
	Loading:      {Ready: true, Failed: true, Unavailable: true, Cancelled: true},
	Ready:        {Resident: true, Expired: true},
	Resident:     {Loading: true, Expired: true},
}

// transition is the one rule book of the machine: it accepts exactly the
// edges documented on the State constants.
func transition(from, to State) error {
	if from >= numStates || to >= numStates || !legal[from][to] {
		return fmt.Errorf("%w: %s -> %s", ErrIllegalTransition, from, to)
	}
	return nil
}
