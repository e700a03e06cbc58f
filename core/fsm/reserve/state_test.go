package reserve

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

func TestTransitions(t *testing.T) {
	const legalEdges = `
		writing        -> ready cancel_pending expire_pending cancelled expired
		ready          -> cancelled expired
		cancel_pending -> cancelled
		expire_pending -> cancelled expired
	`
	pairs := map[[2]State]bool{}
	fsmtest.CheckAll(t, fsmtest.Machine[State]{
		N: numStates, Legal: legalEdges, Illegal: ErrBadTransition, Terminal: State.final,
		Transition: func(from, to State) error {
			if from < numStates && to < numStates {
				pairs[[2]State{from, to}] = true
			}
			r := &region{res: 1, mmHash: "h", state: from}
			err := r.transition(to)
			if err == nil {
				require.Equal(t, to, r.state, "%s -> %s", from, to)
			} else {
				require.Equal(t, from, r.state, "%s -> %s: a refused move leaves the state alone", from, to)
			}
			return err
		},
	})
	require.Len(t, pairs, 36)
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
