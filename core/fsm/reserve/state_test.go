package reserve

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTransitions(t *testing.T) {
	legalEdges := map[[2]State]bool{
		{Writing, Ready}:           true,
		{Writing, CancelPending}:   true,
		{Writing, ExpirePending}:   true,
		{Writing, Cancelled}:       true,
		{Writing, Expired}:         true,
		{Ready, Cancelled}:         true,
		{Ready, Expired}:           true,
		{CancelPending, Cancelled}: true,
		{ExpirePending, Cancelled}: true,
		{ExpirePending, Expired}:   true,
	}
	pairs := 0
	for from := range numStates {
		for to := range numStates {
			pairs++
			t.Run(fmt.Sprintf("%s->%s", from, to), func(t *testing.T) {
				r := &region{res: 1, mmHash: "h", state: from}
				err := r.transition(to)
				if legalEdges[[2]State{from, to}] {
					require.NoError(t, err)
					require.Equal(t, to, r.state)
				} else {
					require.ErrorIs(t, err, ErrBadTransition)
					require.Equal(t, from, r.state, "a refused move leaves the state alone")
				}
			})
		}
	}
	require.Equal(t, 36, pairs)
	r := &region{state: numStates + 1}
	require.ErrorIs(t, r.transition(Ready), ErrBadTransition, "a corrupt state moves nowhere")
}

func TestNames(t *testing.T) {
	for s, want := range map[State]string{
		Writing: "writing", Ready: "ready", CancelPending: "cancel_pending",
		ExpirePending: "expire_pending", Cancelled: "cancelled", Expired: "expired", 42: "State(42)",
	} {
		require.Equal(t, want, s.String())
	}
	for k, want := range map[Kind]string{KindWrite: "write", KindFollow: "follow", KindCached: "cached", 0: "Kind(0)"} {
		require.Equal(t, want, k.String())
	}
}
