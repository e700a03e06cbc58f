package reserve

import (
	"fmt"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/stretchr/testify/require"
)

// owned is an item of owner's, sent on a connection of its own.
func owned(owner, tid, hash string, n uint64) Item {
	return Item{TransferID: tid, MMHash: hash, NBytes: n, Owner: owner, Peer: "conn-" + owner}
}

func newGrantTable(slabBytes uint64, cfg Config) *Table {
	return New(slab.NewSlab(slab.HostMemory(make([]byte, slabBytes))), cfg, testTokens(7))
}

// Another peer who learnt a victim's transfer id repeats its reserve: it
// learns that the transfer is in progress and nothing more, while the
// victim's own retry still gets its grant back.
func TestARepeatedReserveFromAnotherRequesterGetsNoToken(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	victim := tab.Reserve([]Item{owned("victim", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, victim.Err)
	require.Equal(t, KindWrite, victim.Kind)

	for _, thief := range []string{"attacker", ""} {
		stolen := tab.Reserve([]Item{owned(thief, "t1", "h1", 4096)}, epoch)[0]
		require.ErrorIs(t, stolen.Err, ErrInProgress, "requester %q", thief)
		require.True(t, stolen.Token.IsZero(), "no token for %q", thief)
		require.Zero(t, stolen.Res)
		require.Zero(t, stolen.Offset)
		require.NotContains(t, stolen.Err.Error(), victim.Token.String())
	}

	again := tab.Reserve([]Item{owned("victim", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, again.Err)
	require.Equal(t, victim.Token, again.Token, "the victim's own retry gets its grant again")
	require.Equal(t, victim.Res, again.Res)
	require.NoError(t, tab.CheckInvariants())
}

// One requester reserving one hash after another cannot hold the slab nor
// the table: past its quota of pending reservations or bytes it is
// refused with a named reason, and other requesters still get room.
func TestPendingQuotaPerRequester(t *testing.T) {
	tab := newGrantTable(1<<20, Config{MaxPendingPerOwner: 4, MaxPendingBytesPerOwner: 64 << 10})
	var refused []Grant
	for i := range 100 {
		g := tab.Reserve([]Item{owned("flood", fmt.Sprintf("f%d", i), fmt.Sprintf("fh%d", i), 4096)}, epoch)[0]
		if g.Err != nil {
			refused = append(refused, g)
		}
	}
	require.Len(t, refused, 96)
	for _, g := range refused {
		require.ErrorIs(t, g.Err, ErrOverQuota)
		require.ErrorContains(t, g.Err, "flood")
	}
	require.Equal(t, 4, tab.Stats().Regions[Writing])
	ev := tab.Ready().Events
	require.Len(t, ev, 96, "every refused transfer gets its failure event now")
	require.Contains(t, ev[0].Reason, ReasonOverQuota)

	big := tab.Reserve([]Item{owned("bytes", "b1", "bh1", 48<<10), owned("bytes", "b2", "bh2", 32<<10)}, epoch)
	require.NoError(t, big[0].Err)
	require.ErrorIs(t, big[1].Err, ErrOverQuota, "48 KiB + 32 KiB pass the 64 KiB quota")

	other := tab.Reserve([]Item{owned("honest", "h", "hh", 4096)}, epoch)[0]
	require.NoError(t, other.Err, "another requester is unaffected")

	// Completing gives the quota back.
	g := tab.Reserve([]Item{owned("flood", "f0", "fh0", 4096)}, epoch)[0]
	require.NoError(t, g.Err)
	require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	require.NoError(t, tab.Reserve([]Item{owned("flood", "f-next", "fh-next", 4096)}, epoch)[0].Err)
	require.NoError(t, tab.CheckInvariants())
}

// Followers of one transfer are bounded: a flood of transfers joining one
// hash is refused past the bound, and the live records stay bounded.
func TestFollowersOfATransferAreBounded(t *testing.T) {
	tab := newGrantTable(1<<20, Config{MaxFollowers: 8, MaxTombstones: 64})
	w := tab.Reserve([]Item{owned("victim", "w", "popular", 4096)}, epoch)[0]
	require.NoError(t, w.Err)
	refusals := 0
	for i := range 10000 {
		g := tab.Reserve([]Item{owned(fmt.Sprintf("peer%d", i), fmt.Sprintf("x%d", i), "popular", 4096)}, epoch)[0]
		if g.Err != nil {
			require.ErrorIs(t, g.Err, ErrOverQuota)
			refusals++
		}
	}
	require.Equal(t, 10000-8, refusals)
	s := tab.Stats()
	require.Equal(t, 1+8, s.Transfers, "live transfer records are bounded")
	require.LessOrEqual(t, s.Tombstones, 64)
	tab.Ready() // taken: only the events of Complete are counted below
	require.NoError(t, tab.Complete(w.Res, w.Token, epoch))
	ready := 0
	for _, e := range tab.Ready().Events {
		if e.Ready {
			ready++
		}
	}
	require.Equal(t, 1+8, ready, "the writer and its admitted followers are served")
	require.NoError(t, tab.CheckInvariants())
}

// A cancel by transfer id carries no token (the scheduler's cancels, and
// anybody's who learnt the id): it may detach that transfer's follower,
// never end another requester's write. The writer abandons with its token.
func TestACancelWithoutTheTokenNeverEndsAWrite(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	victim := tab.Reserve([]Item{owned("victim", "t1", "h1", 4096)}, epoch)[0]
	require.NoError(t, victim.Err)
	follower := tab.Reserve([]Item{owned("other", "t2", "h1", 4096)}, epoch)[0]
	require.NoError(t, follower.Err)
	require.Equal(t, KindFollow, follower.Kind)

	err := tab.Detach("t1", epoch)
	require.ErrorIs(t, err, ErrNeedsToken)
	st, ok := tab.Status("t1")
	require.True(t, ok, "the write goes on")
	require.Equal(t, Writing, st.State)

	require.NoError(t, tab.Detach("t2", epoch), "a follower detaches by id")
	st2, ok := tab.Status("t2")
	require.True(t, ok && st2.Done, "the follower's transfer ended")
	require.Equal(t, Cancelled, st2.State)

	forged, err := testTokens(99).NewToken()
	require.NoError(t, err)
	require.ErrorIs(t, tab.Complete(victim.Res, forged, epoch), ErrBadToken, "complete without the token is refused")
	require.ErrorIs(t, tab.Abandon(victim.Res, forged, "x", epoch), ErrBadToken, "abandon without the token is refused")
	require.NoError(t, tab.Complete(victim.Res, victim.Token, epoch))
	require.NoError(t, tab.CheckInvariants())
}

// A peer that names more requesters on one connection gains no room:
// its quota counts per connection, and past MaxOwnersPerPeer requesters
// holding records it is refused by name; another connection still gets
// its grants.
func TestQuotaCountsPerConnectionWhateverRequesterItNames(t *testing.T) {
	tab := newGrantTable(1<<20, Config{MaxPendingBytesPerOwner: 48 << 10, MaxOwnersPerPeer: 2})
	on := func(peer, owner, tid string, n uint64) Grant {
		return tab.Reserve([]Item{{TransferID: tid, MMHash: "h-" + tid, NBytes: n, Owner: owner, Peer: peer}}, epoch)[0]
	}
	require.NoError(t, on("conn-a", "first", "a0", 32<<10).Err)
	g := on("conn-a", "second", "a1", 32<<10)
	require.ErrorIs(t, g.Err, ErrOverQuota, "32 KiB + 32 KiB pass the connection's 48 KiB, whoever asks")
	require.ErrorContains(t, g.Err, "max_pending_bytes_per_producer")
	require.NoError(t, on("conn-a", "second", "a2", 4<<10).Err, "within the connection's quota")
	g = on("conn-a", "third", "a3", 4<<10)
	require.ErrorIs(t, g.Err, ErrOverQuota)
	require.ErrorContains(t, g.Err, "max_requesters_per_connection", "a third requester on one connection is refused by name")
	require.Equal(t, map[string]uint64{QuotaPendingBytes: 1, QuotaRequesters: 1}, tab.Stats().OverQuota)

	require.NoError(t, on("conn-b", "honest", "b0", 32<<10).Err, "another connection gets its grant")
	require.NoError(t, tab.CheckInvariants())

	// A requester's records gone, its place among the connection's
	// requesters is free again.
	g0 := tab.Reserve([]Item{{TransferID: "a0", MMHash: "h-a0", NBytes: 32 << 10, Owner: "first", Peer: "conn-a"}}, epoch)[0]
	require.NoError(t, tab.Complete(g0.Res, g0.Token, epoch))
	require.NoError(t, on("conn-a", "third", "a4", 4<<10).Err)
	require.NoError(t, tab.CheckInvariants())
}
