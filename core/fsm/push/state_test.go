package push

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

// The legal edges, written out once more independently of the table in
// state.go, so that a change to either is caught here.
const wantEdges = `
	Reserving     -> WaitingInputs Done Cancelled Failed
	WaitingInputs -> Writing Cancelled Failed
	Writing       -> Notifying Done CancelPending Failed
	Notifying     -> Done Failed
	CancelPending -> Cancelled Failed
`

func TestTransitions(t *testing.T) {
	fsmtest.CheckAll(t, fsmtest.Machine[State]{
		N: numStates, Transition: transition, Legal: wantEdges,
		Illegal: ErrIllegalTransition, Terminal: State.Terminal,
	})
}

func TestStateString(t *testing.T) {
	require.Equal(t, "State(99)", State(99).String())
}
