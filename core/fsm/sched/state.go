package sched

import (
	"github.com/ecmooncake/ecmooncake/core/internal/enum"
	"github.com/ecmooncake/ecmooncake/core/internal/machine"
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

// legal is the one rule book of the machine: exactly the edges documented
// on the State constants.
var legal = machine.NewEdges(numStates, map[State][]State{
	WaitingEvent: {Available, Unavailable, Cancelled},
	Available:    {Loading, Expired, Cancelled},
	Loading:      {Ready, Failed, Unavailable, Cancelled},
	Ready:        {Resident, Expired},
	Resident:     {Loading, Expired},
})

// transition checks one move against legal.
func transition(from, to State) error { return legal.Check(from, to) }
