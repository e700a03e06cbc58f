package push

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

// The legal edges, written out once more independently of the table in
// state.go, so that a change to either is caught here.
var wantEdges = map[[2]State]bool{
	{Reserving, WaitingInputs}: true,
	{Reserving, Done}:          true,
	{Reserving, Cancelled}:     true,
	{Reserving, Failed}:        true,
	{WaitingInputs, Writing}:   true,
	{WaitingInputs, Cancelled}: true,
	{WaitingInputs, Failed}:    true,
	{Writing, Notifying}:       true,
	{Writing, CancelPending}:   true,
	{Writing, Failed}:          true,
	{Notifying, Done}:          true,
	{Notifying, Failed}:        true,
	{CancelPending, Cancelled}: true,
	{CancelPending, Failed}:    true,
}

func TestTransitions(t *testing.T) {
	fsmtest.CheckAll(t, fsmtest.Machine[State]{
		N: numStates, Transition: transition, Legal: wantEdges,
		Illegal: ErrIllegalTransition, Terminal: State.Terminal,
	})
}

func TestStateString(t *testing.T) {
	require.Equal(t, "State(99)", State(99).String())
}
