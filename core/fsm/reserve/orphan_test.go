package reserve

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// readyOf is the transfer ids of the Ready events in ev.
func readyOf(ev []Event) []string {
	var out []string
	for _, e := range ev {
		if e.Ready {
			out = append(out, e.TransferID)
		}
	}
	return out
}

// An encoder killed after its reserve: its connection ends, and the proxy
// sends the same transfer to a second encoder. That encoder's reserve
// takes the write over (a region of its own: the dead writer's may still
// see a late write), and the transfers waiting on the old write are
// served by the new one. Before the connection ended, the same reserve
// was refused, as it is for anyone who learnt the id.
func TestAWriteWhoseConnectionEndedIsTakenOverByTheSameTransfer(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	dead := tab.Reserve([]Item{owned("a", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, dead.Err)
	follower := tab.Reserve([]Item{owned("c", "t2", "h1", 4096)}, epoch)[0]
	require.Equal(t, KindFollow, follower.Kind)
	require.ErrorIs(t, tab.Reserve([]Item{owned("b", "t1", "h1", 4096)}, epoch)[0].Err, ErrInProgress)

	require.Equal(t, 0, tab.PeerGone("conn-b", epoch), "another connection's end orphans nothing of a's")
	require.Equal(t, 1, tab.PeerGone("conn-a", epoch))
	tab.Ready()
	g := tab.Reserve([]Item{owned("b", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, g.Err)
	require.Equal(t, KindWrite, g.Kind)
	require.NotEqual(t, dead.Res, g.Res, "a region of its own")
	require.NotEqual(t, dead.Token, g.Token)
	require.Empty(t, tab.Ready().Events, "nothing failed: the transfers wait on the new write")
	require.Equal(t, uint64(1), tab.Stats().TakenOver)

	require.ErrorIs(t, tab.Complete(dead.Res, dead.Token, epoch), ErrGone, "the dead writer's grant is over")
	require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	require.ElementsMatch(t, []string{"t1", "t2"}, readyOf(tab.Ready().Events))
	require.Equal(t, uint64(4096), tab.Stats().BytesInUse, "the old region's memory went back")
	require.NoError(t, tab.CheckInvariants())
}

// A new request for the content, under a fresh transfer id, while the
// only write of it is orphaned: it writes instead of following a write
// that may never come, and the orphan's transfer follows it.
func TestAFreshTransferOfOrphanedContentWritesAndTheOrphanFollows(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	dead := tab.Reserve([]Item{owned("a", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, dead.Err)
	tab.PeerGone("conn-a", epoch)
	g := tab.Reserve([]Item{owned("b", "t3", "h1", 4096)}, epoch)[0]
	require.NoError(t, g.Err)
	require.Equal(t, KindWrite, g.Kind)
	st, ok := tab.Status("t1")
	require.True(t, ok)
	require.Equal(t, KindFollow, st.Kind, "the orphan's transfer follows the new write")
	require.False(t, st.Done)

	// The transfer that took over is an ordinary write: a repeat of the
	// old id by yet another requester follows, and gets no token.
	again := tab.Reserve([]Item{owned("x", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, again.Err)
	require.Equal(t, KindFollow, again.Kind)
	require.True(t, again.Token.IsZero())

	require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	require.ElementsMatch(t, []string{"t1", "t3"}, readyOf(tab.Ready().Events))
	require.NoError(t, tab.CheckInvariants())
}

// A writer whose one-sided write may still land keeps its memory: the
// old region waits, cancelled, for that write's end before its room goes
// back, and the new write has a region elsewhere.
func TestATakenOverRegionKeepsItsMemoryUntilItsWriteEnds(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	dead := tab.Reserve([]Item{owned("a", "t1", "h1", 4096)}, epoch)[0]
	_, err := tab.BeginWrite(dead.Res, dead.Token, 0, 4096, epoch)
	require.NoError(t, err)
	tab.PeerGone("conn-a", epoch)
	g := tab.Reserve([]Item{owned("b", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, g.Err)
	require.NotEqual(t, dead.Offset, g.Offset)
	s := tab.Stats()
	require.Equal(t, 1, s.Regions[CancelPending])
	require.Equal(t, uint64(8192), s.BytesInUse)
	tab.EndWrite(dead.Res, true, epoch)
	require.Equal(t, uint64(4096), tab.Stats().BytesInUse)
	require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	require.Equal(t, []string{"t1"}, readyOf(tab.Ready().Events))
	require.NoError(t, tab.CheckInvariants())
}

// The writer itself, back on a new connection (its old one idled out),
// gets its grant again, and the write is no longer up for taking.
func TestAWriterBackOnANewConnectionKeepsItsWrite(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	first := tab.Reserve([]Item{owned("a", "t1", "h1", 4096)}, epoch)[0]
	tab.PeerGone("conn-a", epoch)
	back := Item{TransferID: "t1", MMHash: "h1", NBytes: 4096, Owner: "a", Peer: "conn-a2"}
	again := tab.Reserve([]Item{back}, epoch)[0]
	require.NoError(t, again.Err)
	require.Equal(t, first.Res, again.Res)
	require.Equal(t, first.Token, again.Token)
	require.ErrorIs(t, tab.Reserve([]Item{owned("b", "t1", "h1", 4096)}, epoch)[0].Err, ErrInProgress)
	require.Equal(t, KindFollow, tab.Reserve([]Item{owned("b", "t9", "h1", 4096)}, epoch)[0].Kind)
	require.Zero(t, tab.Stats().TakenOver)
	require.NoError(t, tab.CheckInvariants())
}

// A producer with standing credit wrote the content into its window while
// the only write of it is orphaned: its claim files those bytes as the
// ready copy (nothing wasted, no second copy), and the orphan's transfers
// are served by it at once.
func TestAClaimOfOrphanedContentIsTheCopy(t *testing.T) {
	tab := newCreditTable(t, 1<<20)
	dead := tab.Reserve([]Item{owned("a", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, dead.Err)
	tab.PeerGone("conn-a", epoch)
	tab.Ready()
	c := creditOf(t, tab, "p", epoch)
	base := c.Extents[0].Off
	g := tab.Claim([]Claim{claimAt("p", "t2", "h1", 4096, base, c)}, epoch)[0]
	require.NoError(t, g.Err)
	require.Equal(t, KindWrite, g.Kind)
	require.True(t, g.TookOver)
	require.Equal(t, base, g.Offset)
	require.ElementsMatch(t, []string{"t1", "t2"}, readyOf(tab.Ready().Events))
	s := tab.Stats()
	require.Zero(t, s.Credit.Wasted)
	require.Equal(t, uint64(1), s.TakenOver)
	require.Equal(t, uint64(creditWindow), s.BytesInUse, "the old region's room went back")
	require.NoError(t, tab.CheckInvariants())
}

// No room for a second region: nothing is taken over, and the reserve is
// answered as if the write were not orphaned (the same transfer refused,
// a new one following), so the orphan's transfers are left as they were.
func TestNoTakeOverWithoutRoom(t *testing.T) {
	tab := newGrantTable(8192, Config{})
	dead := tab.Reserve([]Item{owned("a", "t1", "h1", 8192)}, epoch)[0]
	require.NoError(t, dead.Err)
	tab.PeerGone("conn-a", epoch)
	require.ErrorIs(t, tab.Reserve([]Item{owned("b", "t1", "h1", 8192)}, epoch)[0].Err, ErrInProgress)
	g := tab.Reserve([]Item{owned("b", "t2", "h1", 8192)}, epoch)[0]
	require.NoError(t, g.Err)
	require.Equal(t, KindFollow, g.Kind)
	require.Zero(t, tab.Stats().TakenOver)
	st, ok := tab.Status("t1")
	require.True(t, ok)
	require.Equal(t, KindWrite, st.Kind)
	require.NoError(t, tab.Complete(dead.Res, dead.Token, epoch), "the orphaned writer may still complete")
	require.ElementsMatch(t, []string{"t1", "t2"}, readyOf(tab.Ready().Events))
	require.NoError(t, tab.CheckInvariants())
}
