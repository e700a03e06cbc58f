package push

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// A write granted from a standing credit window is provisional: the shard
// rules on it only when its bytes are claimed, and may then make it follow
// another push's write of the same content. Until its write ends, that
// other write is not given up when its push is cancelled; once the claim
// was answered follower (FollowsAt), it is followed and goes on; answered
// as its own write, the cancel takes effect.
func TestProvisionalGrantHoldsACancelUntilItsClaimIsAnswered(t *testing.T) {
	for _, tc := range []struct {
		name    string
		follows bool
		want    State // t2 once t1's write ended
	}{
		{"claim answered follower", true, Writing},
		{"claim answered write", false, CancelPending},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := New(Config{})
			// Both announced at once; the runtime took t1's region from its
			// window and reserved t2's, which the shard granted as a write.
			require.NoError(t, m.Add(Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Dests: []string{"d1"}}, base))
			require.NoError(t, m.Add(Push{TransferID: "t2", MMHash: "h1", NBytes: 100, Dests: []string{"d1"}}, base))
			require.Len(t, m.Ready(base).Reserves["d1"], 2)
			credit := ids.ResID(1<<63 + 1)
			m.Granted("t1", "d1", Grant{Kind: KindWrite, Res: credit, Token: tokenFor(credit), NBytes: 100, Provisional: true}, base)
			m.Granted("t2", "d1", Grant{Kind: KindWrite, Res: 5, Token: tokenFor(5), NBytes: 100}, base)
			require.NoError(t, m.SourceReady("h1", 11, 100, base))
			require.Len(t, m.Ready(base).Writes["d1"], 2)

			m.Cancel("t2", base)
			st, _ := m.Status("t2")
			require.Equal(t, Writing, st["d1"], "t1 may yet follow t2's write: the cancel waits")

			if tc.follows {
				m.FollowsAt("t1", "d1", base)
			}
			m.WriteDoneInBand("t1", "d1", nil, base)
			st, _ = m.Status("t1")
			require.Equal(t, Done, st["d1"])
			st, _ = m.Status("t2")
			require.Equal(t, tc.want, st["d1"])
			require.NoError(t, m.CheckInvariants())
		})
	}
}

// Shared says whether more than one live push carries a content.
func TestShared(t *testing.T) {
	m := New(Config{})
	require.False(t, m.Shared("h1"))
	require.NoError(t, m.Add(Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Dests: []string{"d1"}}, base))
	require.False(t, m.Shared("h1"))
	require.NoError(t, m.Add(Push{TransferID: "t2", MMHash: "h1", NBytes: 100, Dests: []string{"d2"}}, base))
	require.True(t, m.Shared("h1"))
}
