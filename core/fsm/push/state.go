package push

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/internal/enum"
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
	// → Notifying | CancelPending | Failed.
	Writing
	// Notifying: the bytes landed; the complete is out or about to be.
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

var legal = [numStates][numStates]bool{
	Reserving:     {WaitingInputs: true, Done: true, Cancelled: true, Failed: true},
	WaitingInputs: {Writing: true, Cancelled: true, Failed: true},
	Writing:       {Notifying: true, CancelPending: true, Failed: true},
	Notifying:     {Done: true, Failed: true},
	CancelPending: {Cancelled: true, Failed: true},
}

// transition is the one rule book of the machine: it accepts exactly the
// edges documented on the State constants.
func transition(from, to State) error {
	if from >= numStates || to >= numStates || !legal[from][to] {
		return fmt.Errorf("%w: %s -> %s", ErrIllegalTransition, from, to)
	}
	return nil
}
