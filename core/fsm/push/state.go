package push

import (
	"github.com/ecmooncake/ecmooncake/core/internal/enum"
	"github.com/ecmooncake/ecmooncake/core/internal/machine"
)

// State is where the push of one transfer to one destination shard stands.
// Each constant lists the states it may move to; transition is the only
// place that enforces them.
type State uint8

const (
	// Reserving: a reservation was asked for (or is about to be) and no
	// grant came back yet. It is the first half of the design's
	// WAITING_INPUTS: the push waits for its destination region here and
	// for its source in WaitingInputs.
	// → WaitingInputs | Done (follow/cached grant) | Cancelled | Failed.
	Reserving State = iota
	// WaitingInputs: the region is granted; the encoder output is not yet
	// available. → Writing | Cancelled | Failed.
	WaitingInputs
	// Writing: the write was handed out and reads the source.
	// → Notifying | Done (completed in-band) | CancelPending | Failed.
	Writing
	// Notifying: the bytes landed and the record holds no source; the
	// complete is out, or waits for a place in its destination's window.
	// → Done | Failed.
	Notifying
	// Done (terminal): the destination has the bytes or will get them from
	// another writer.
	Done
	// CancelPending: cancelled while the write is in flight; the source
	// stays until the write finishes. → Cancelled | Failed.
	CancelPending
	// Cancelled (terminal).
	Cancelled
	// Failed (terminal).
	Failed

	numStates
)

var stateNames = [numStates]string{
	Reserving:     "Reserving",
	WaitingInputs: "WaitingInputs",
	Writing:       "Writing",
	Notifying:     "Notifying",
	Done:          "Done",
	CancelPending: "CancelPending",
	Cancelled:     "Cancelled",
	Failed:        "Failed",
}

func (s State) String() string { return enum.Name("State", stateNames[:], s) }

// Terminal reports whether s ends the push to one destination.
func (s State) Terminal() bool {
	return s == Done || s == Cancelled || s == Failed
}

// needsSource reports whether a record in s may still have to write, so its
// content's source must be kept.
func (s State) needsSource() bool {
	return s == Reserving || s == WaitingInputs
}

// legal is the one rule book of the machine: exactly the edges documented
// on the State constants.
var legal = machine.NewEdges(numStates, map[State][]State{
	Reserving:     {WaitingInputs, Done, Cancelled, Failed},
	WaitingInputs: {Writing, Cancelled, Failed},
	Writing:       {Notifying, Done, CancelPending, Failed},
	Notifying:     {Done, Failed},
	CancelPending: {Cancelled, Failed},
})

// transition checks one move against legal.
func transition(from, to State) error { return legal.Check(from, to) }
