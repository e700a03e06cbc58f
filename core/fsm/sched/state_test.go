package sched

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

// The legal edges, written out once more independently of the table in
// state.go, so that a change to either is caught here.
const wantEdges = `
	WaitingEvent -> Available Unavailable Cancelled
	Available    -> Loading Expired Cancelled
	Loading      -> Ready Failed Unavailable Cancelled
	Ready        -> Resident Expired
	Resident     -> Loading Expired
`

func TestTransitions(t *testing.T) {
	fsmtest.CheckAll(t, fsmtest.Machine[State]{
		N: numStates, Transition: transition, Legal: wantEdges,
		Illegal: ErrIllegalTransition, Terminal: State.Terminal,
	})
}

func TestStateString(t *testing.T) {
	require.Equal(t, "State(200)", State(200).String())
	require.True(t, errors.Is(transition(State(200), Available), ErrIllegalTransition))
}
