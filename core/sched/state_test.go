package sched

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// The legal edges, written out once more independently of the table in
// state.go, so that a change to either is caught here.
var wantEdges = map[[2]State]bool{
	{WaitingEvent, Available}:   true,
	{WaitingEvent, Unavailable}: true,
	{WaitingEvent, Cancelled}:   true,
	{Available, Loading}:        true,
	{Available, Expired}:        true,
	{Available, Cancelled}:      true,
	{Loading, Ready}:            true,
	{Loading, Failed}:           true,
	{Loading, Unavailable}:      true,
	{Loading, Cancelled}:        true,
	{Ready, Resident}:           true,
	{Ready, Expired}:            true,
	{Resident, Loading}:         true,
	{Resident, Expired}:         true,
}

func TestTransitionAllPairs(t *testing.T) {
	for from := State(0); from <= numStates; from++ {
		for to := State(0); to <= numStates; to++ {
			err := transition(from, to)
			if wantEdges[[2]State{from, to}] {
				require.NoError(t, err, "%s -> %s", from, to)
				continue
			}
			require.ErrorIs(t, err, ErrIllegalTransition, "%s -> %s", from, to)
			require.Contains(t, err.Error(), from.String()+" -> "+to.String())
		}
	}
}

func TestTerminalStatesHaveNoExits(t *testing.T) {
	for s := State(0); s < numStates; s++ {
		exits := 0
		for to := State(0); to < numStates; to++ {
			if transition(s, to) == nil {
				exits++
			}
		}
		require.Equal(t, s.Terminal(), exits == 0, "%s: terminal=%v with %d exits", s, s.Terminal(), exits)
	}
}

func TestStateString(t *testing.T) {
	seen := map[string]bool{}
	for s := State(0); s < numStates; s++ {
		name := s.String()
		require.NotEmpty(t, name)
		require.False(t, seen[name], "duplicate name %s", name)
		seen[name] = true
	}
	require.Equal(t, "State(200)", State(200).String())
	require.True(t, errors.Is(transition(State(200), Available), ErrIllegalTransition))
}
