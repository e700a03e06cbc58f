package reserve

import (
	"fmt"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

const creditWindow = 64 << 10

func newCreditTable(t *testing.T, slabBytes uint64) *Table {
	t.Helper()
	return newGrantTable(slabBytes, Config{CreditWindowBytes: creditWindow, CreditLease: 10 * time.Second})
}

// grantFor gives owner (on its own connection) a window.
func creditOf(t *testing.T, tab *Table, owner string, now time.Time) Credit {
	t.Helper()
	c, ok := tab.Credit("conn-"+owner, owner, creditWindow, now)
	require.True(t, ok)
	return c
}

// claimAt is owner's claim of n bytes of hash at off under c.
func claimAt(owner, tid, hash string, n, off uint64, c Credit) Claim {
	return Claim{Item: owned(owner, tid, hash, n), Offset: off, Gen: c.Gen, Token: c.Token}
}

// A claim inside the window files a region already written: Ready events
// out at once, loadable, and the window holds the rest of its room.
func TestClaimFilesReadyRegions(t *testing.T) {
	tab := newCreditTable(t, 1<<20)
	c := creditOf(t, tab, "p", epoch)
	require.Len(t, c.Extents, 1)
	require.Equal(t, uint64(creditWindow), c.Bytes())
	base := c.Extents[0].Off

	g := tab.Claim([]Claim{
		claimAt("p", "t1", "h1", 4000, base, c),
		claimAt("p", "t2", "h2", 8192, base+4096, c),
	}, epoch)
	for _, x := range g {
		require.NoError(t, x.Err)
		require.Equal(t, KindWrite, x.Kind)
	}
	require.Equal(t, base, g[0].Offset)
	require.Equal(t, base+4096, g[1].Offset)
	ev := tab.Ready().Events
	require.Len(t, ev, 2)
	require.True(t, ev[0].Ready && ev[1].Ready)
	off, n, err := tab.Acquire("h2", epoch)
	require.NoError(t, err)
	require.Equal(t, base+4096, off)
	require.Equal(t, uint64(8192), n)

	st := tab.Stats()
	require.Equal(t, uint64(2), st.Credit.Claimed)
	require.Equal(t, uint64(creditWindow-4096-8192), st.Credit.WindowBytes)
	require.Equal(t, uint64(creditWindow), st.BytesInUse, "the window's room and the regions carved from it")
	require.Equal(t, uint64(2), st.Completed)
	require.NoError(t, tab.CheckInvariants())

	// Renewing tops the window up again from free room.
	c2 := creditOf(t, tab, "p", epoch.Add(time.Second))
	require.Equal(t, c.Gen, c2.Gen, "a renewal keeps the generation")
	require.Equal(t, uint64(creditWindow), c2.Bytes())
	require.NoError(t, tab.CheckInvariants())
}

// Every hostile or stale claim is refused before any region exists: the
// slab, the window and the events are as they were, and the refusal is
// counted by reason.
func TestHostileClaimsAreRefused(t *testing.T) {
	type fixture struct {
		tab   *Table
		c     Credit // p's window
		other Credit // q's window
		base  uint64
	}
	cases := []struct {
		name   string
		claim  func(f fixture) (Claim, time.Time)
		err    error
		reason string
	}{
		{"stale generation", func(f fixture) (Claim, time.Time) {
			cl := claimAt("p", "x", "hx", 4096, f.base, f.c)
			cl.Gen++
			return cl, epoch
		}, ErrStaleCredit, ClaimStale},
		{"another producer's generation and token", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base, f.other), epoch
		}, ErrStaleCredit, ClaimStale},
		{"another producer's token", func(f fixture) (Claim, time.Time) {
			cl := claimAt("p", "x", "hx", 4096, f.base, f.c)
			cl.Token = f.other.Token
			return cl, epoch
		}, ErrBadToken, ClaimBadToken},
		{"a zero token", func(f fixture) (Claim, time.Time) {
			cl := claimAt("p", "x", "hx", 4096, f.base, f.c)
			cl.Token = ids.Token{}
			return cl, epoch
		}, ErrBadToken, ClaimBadToken},
		{"naming another requester from its own connection", func(f fixture) (Claim, time.Time) {
			cl := claimAt("p", "x", "hx", 4096, f.base, f.c)
			cl.Peer = "conn-q"
			return cl, epoch
		}, ErrNoCredit, ClaimNoCredit},
		{"no window at all", func(f fixture) (Claim, time.Time) {
			return claimAt("stranger", "x", "hx", 4096, f.base, f.c), epoch
		}, ErrNoCredit, ClaimNoCredit},
		{"past the window", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base+creditWindow, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"running past the window's end", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 8192, f.base+creditWindow-4096, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"larger than the slab", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 1<<63, f.base, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"unaligned offset", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base+8, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"in another producer's window", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.other.Extents[0].Off, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"overlapping an earlier claim", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base+4096, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"replaying a claimed extent under another id", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base, f.c), epoch
		}, ErrOutOfBounds, ClaimOutOfRoom},
		{"at the lease's end", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "hx", 4096, f.base+16384, f.c), f.c.Deadline
		}, ErrStaleCredit, ClaimStale},
		{"empty mm_hash", func(f fixture) (Claim, time.Time) {
			return claimAt("p", "x", "", 4096, f.base+16384, f.c), epoch
		}, ErrInvalid, ClaimInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tab := newCreditTable(t, 1<<20)
			f := fixture{tab: tab, c: creditOf(t, tab, "p", epoch), other: creditOf(t, tab, "q", epoch)}
			f.base = f.c.Extents[0].Off
			// One earlier claim covers [base, base+8192).
			require.NoError(t, tab.Claim([]Claim{claimAt("p", "t0", "h0", 8192, f.base, f.c)}, epoch)[0].Err)
			tab.Ready()
			before := tab.Stats()

			cl, now := tc.claim(f)
			g := tab.Claim([]Claim{cl}, now)[0]
			require.ErrorIs(t, g.Err, tc.err)
			require.True(t, g.Token.IsZero())
			require.Zero(t, g.Res)
			require.NotContains(t, g.Err.Error(), f.c.Token.String())

			after := tab.Stats()
			require.Equal(t, before.BytesInUse, after.BytesInUse)
			require.Equal(t, before.Credit.WindowBytes, after.Credit.WindowBytes)
			require.Equal(t, before.Regions, after.Regions)
			require.Equal(t, before.Credit.Claimed, after.Credit.Claimed)
			require.Equal(t, uint64(1), after.Credit.Refused[tc.reason])
			require.Empty(t, tab.Ready().Events)
			require.NoError(t, tab.CheckInvariants())
		})
	}
}

// A claim repeated after a lost reply is answered with its grant again:
// no second region, no second event, the window untouched.
func TestReplayedClaimIsAnsweredAgain(t *testing.T) {
	tab := newCreditTable(t, 1<<20)
	c := creditOf(t, tab, "p", epoch)
	cl := claimAt("p", "t1", "h1", 4096, c.Extents[0].Off, c)
	first := tab.Claim([]Claim{cl}, epoch)[0]
	require.NoError(t, first.Err)
	require.Len(t, tab.Ready().Events, 1)
	window := tab.Stats().Credit.WindowBytes

	again := tab.Claim([]Claim{cl}, epoch)[0]
	require.NoError(t, again.Err)
	require.Equal(t, first.Res, again.Res)
	require.Empty(t, tab.Ready().Events)
	st := tab.Stats()
	require.Equal(t, window, st.Credit.WindowBytes)
	require.Equal(t, 1, st.Regions[Ready])
	require.Equal(t, uint64(1), st.Credit.Replayed)

	// The same transfer id claimed by another requester learns nothing.
	q := creditOf(t, tab, "q", epoch)
	stolen := tab.Claim([]Claim{claimAt("q", "t1", "h1", 4096, q.Extents[0].Off, q)}, epoch)[0]
	require.ErrorIs(t, stolen.Err, ErrInProgress, "a write grant is repeated only to its owner")
	require.True(t, stolen.Token.IsZero())
	require.NoError(t, tab.CheckInvariants())
}

// Dedup keeps working: a claim for content the shard holds is answered
// cached, one for content being written follows that write; either way
// the extent stays in the window and the write is counted as wasted.
func TestClaimOfKnownContentIsDeduplicated(t *testing.T) {
	tab := newCreditTable(t, 1<<20)
	writing := tab.Reserve([]Item{owned("r", "w1", "hw", 4096)}, epoch)[0]
	require.NoError(t, writing.Err)
	c := creditOf(t, tab, "p", epoch)
	require.NoError(t, tab.Claim([]Claim{claimAt("p", "t1", "hr", 4096, c.Extents[0].Off, c)}, epoch)[0].Err)
	tab.Ready()
	c = creditOf(t, tab, "p", epoch)
	window := tab.Stats().Credit.WindowBytes
	base := c.Extents[0].Off

	g := tab.Claim([]Claim{
		claimAt("p", "t2", "hr", 4096, base, c),
		claimAt("p", "t3", "hw", 4096, base, c),
	}, epoch)
	require.NoError(t, g[0].Err)
	require.Equal(t, KindCached, g[0].Kind)
	require.NoError(t, g[1].Err)
	require.Equal(t, KindFollow, g[1].Kind)
	st := tab.Stats()
	require.Equal(t, window, st.Credit.WindowBytes, "both extents went back to the window")
	require.Equal(t, uint64(2), st.Credit.Wasted)
	ev := tab.Ready().Events
	require.Len(t, ev, 1)
	require.Equal(t, "t2", ev[0].TransferID)

	require.NoError(t, tab.Complete(writing.Res, writing.Token, epoch))
	ev = tab.Ready().Events
	require.Len(t, ev, 2, "the follower is ready with the write it followed")
	require.NoError(t, tab.CheckInvariants())
}

// A producer killed with credit outstanding: its window goes back to the
// slab when the lease ends, and every byte is accounted for; a claim
// against it afterwards is refused, and the slab is clean once the
// regions carved from it end.
func TestWindowReturnsAtLeaseEnd(t *testing.T) {
	tab := newCreditTable(t, 1<<20)
	c := creditOf(t, tab, "p", epoch)
	require.NoError(t, tab.Claim([]Claim{claimAt("p", "t1", "h1", 4096, c.Extents[0].Off, c)}, epoch)[0].Err)
	tab.Ready()
	at, ok := tab.NextDeadline()
	require.True(t, ok)
	require.Equal(t, c.Deadline, at, "the window's lease ends before the region's")

	tab.Tick(c.Deadline)
	st := tab.Stats()
	require.Zero(t, st.Credit.Windows)
	require.Zero(t, st.Credit.WindowBytes)
	require.Equal(t, uint64(1), st.Credit.Expired)
	require.Equal(t, uint64(4096), st.BytesInUse, "only the claimed region is left")
	require.NoError(t, tab.CheckInvariants())

	g := tab.Claim([]Claim{claimAt("p", "t2", "h2", 4096, c.Extents[0].Off+4096, c)}, c.Deadline)[0]
	require.ErrorIs(t, g.Err, ErrNoCredit)

	// A new window is a new generation: the old one's claims stay refused.
	c2 := creditOf(t, tab, "p", c.Deadline)
	require.NotEqual(t, c.Gen, c2.Gen)
	require.ErrorIs(t, tab.Claim([]Claim{claimAt("p", "t2", "h2", 4096, c2.Extents[0].Off, c)}, c.Deadline)[0].Err, ErrStaleCredit)

	tab.DropCredit("conn-p", "p")
	tab.Tick(c.Deadline.Add(time.Hour))
	require.Zero(t, tab.Stats().BytesInUse, "every slab byte is back")
	require.NoError(t, tab.CheckInvariants())
}

// A shard that restarted holds no window: the producer's claims are
// refused, and it reserves instead.
func TestClaimAfterShardRestart(t *testing.T) {
	old := newCreditTable(t, 1<<20)
	c := creditOf(t, old, "p", epoch)
	restarted := newCreditTable(t, 1<<20)
	g := restarted.Claim([]Claim{claimAt("p", "t1", "h1", 4096, c.Extents[0].Off, c)}, epoch)[0]
	require.ErrorIs(t, g.Err, ErrNoCredit)
	require.NoError(t, restarted.Reserve([]Item{owned("p", "t1", "h1", 4096)}, epoch)[0].Err, "the refused claim reserves")

	// A new window on the restarted shard has the same generation
	// number as the old one, but not its token.
	c2 := creditOf(t, restarted, "p", epoch)
	require.Equal(t, c.Gen, c2.Gen)
	require.ErrorIs(t, restarted.Claim([]Claim{claimAt("p", "t2", "h2", 4096, c2.Extents[0].Off, c)}, epoch)[0].Err, ErrBadToken)
	require.NoError(t, restarted.CheckInvariants())
}

// A slab held by items in use is backpressure: the window holds what free
// room there is, possibly nothing; resident copies make room for it as
// they would for the reservations it stands for. Off, or asked for
// nothing, there is no window.
func TestCreditIsBackpressured(t *testing.T) {
	tab := newGrantTable(1<<20, Config{})
	_, ok := tab.Credit("conn-p", "p", creditWindow, epoch)
	require.False(t, ok, "off by default")

	tab = newGrantTable(256<<10, Config{CreditWindowBytes: creditWindow, MaxPendingBytesPerOwner: 1 << 30})
	_, ok = tab.Credit("conn-p", "p", 0, epoch)
	require.False(t, ok, "nothing asked")
	pinned := tab.Reserve([]Item{owned("r", "t1", "h1", 160<<10)}, epoch)[0]
	require.NoError(t, pinned.Err)
	require.NoError(t, tab.Complete(pinned.Res, pinned.Token, epoch))
	_, _, err := tab.Acquire("h1", epoch)
	require.NoError(t, err)
	resident := tab.Reserve([]Item{owned("r", "t2", "h2", 64<<10)}, epoch)[0]
	require.NoError(t, resident.Err)
	require.NoError(t, tab.Complete(resident.Res, resident.Token, epoch))
	_, _, err = tab.Acquire("h2", epoch)
	require.NoError(t, err)
	require.NoError(t, tab.Release("h2", epoch))

	c, ok := tab.Credit("conn-p", "p", creditWindow, epoch)
	require.True(t, ok)
	require.Equal(t, uint64(creditWindow), c.Bytes(), "the resident went for the window, the pinned item stays")
	require.Zero(t, tab.Stats().Residents)
	require.Equal(t, uint64(1), tab.Stats().Evictions)
	require.NoError(t, tab.CheckInvariants())

	// What is left goes to the next window, then nothing.
	part, ok := tab.Credit("conn-q", "q", creditWindow, epoch)
	require.True(t, ok)
	require.Equal(t, uint64(32<<10), part.Bytes())
	empty, ok := tab.Credit("conn-s", "s", creditWindow, epoch)
	require.True(t, ok)
	require.Zero(t, empty.Bytes())
	require.NoError(t, tab.CheckInvariants())
}

// A reservation that needs room evicts resident copies around a window,
// never into it: the window's room cuts the slab like a region in use.
func TestEvictionForAReservationSparesWindows(t *testing.T) {
	tab := newGrantTable(256<<10, Config{CreditWindowBytes: creditWindow, MaxPendingBytesPerOwner: 1 << 30})
	// Residents [0,64K) [64K,128K), then the window [128K,192K), then a
	// resident [192K,256K): 128K contiguous only on the left.
	for i, n := range []uint64{64 << 10, 64 << 10} {
		g := tab.Reserve([]Item{owned("r", fmt.Sprint("t", i), fmt.Sprint("h", i), n)}, epoch)[0]
		require.NoError(t, g.Err)
		require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	}
	c, ok := tab.Credit("conn-p", "p", creditWindow, epoch)
	require.True(t, ok)
	require.Equal(t, uint64(128<<10), c.Extents[0].Off)
	g := tab.Reserve([]Item{owned("r", "t9", "h9", 64<<10)}, epoch)[0]
	require.NoError(t, g.Err)
	require.NoError(t, tab.Complete(g.Res, g.Token, epoch))
	for _, h := range []string{"h0", "h1", "h9"} {
		_, _, err := tab.Acquire(h, epoch)
		require.NoError(t, err)
		require.NoError(t, tab.Release(h, epoch))
	}
	// The oldest residents h0 and h1 are adjacent; h9 is alone past the
	// window. 128K fits only by evicting h0 and h1.
	g = tab.Reserve([]Item{owned("r", "big", "hbig", 128<<10)}, epoch)[0]
	require.NoError(t, g.Err)
	require.Zero(t, g.Offset)
	require.NoError(t, tab.CheckInvariants())
	// 192K cannot fit anywhere without the window's room: refused.
	require.ErrorIs(t, tab.Reserve([]Item{owned("r", "huge", "hhuge", 192<<10)}, epoch)[0].Err, ErrPoolFull)
	require.NoError(t, tab.CheckInvariants())
}

// A peer gets windows for at most MaxOwnersPerPeer requesters.
func TestCreditWindowsPerPeerAreBounded(t *testing.T) {
	tab := newGrantTable(1<<24, Config{CreditWindowBytes: 4096, MaxOwnersPerPeer: 2})
	for i, want := range []bool{true, true, false} {
		_, ok := tab.Credit("conn", string(rune('a'+i)), 4096, epoch)
		require.Equal(t, want, ok, "requester %d", i)
	}
	require.NoError(t, tab.CheckInvariants())
}

// The window is capped at a quarter of the slab.
func TestCreditWindowIsCapped(t *testing.T) {
	tab := New(slab.NewSlab(slab.HostMemory(make([]byte, 1<<20))), Config{CreditWindowBytes: 1 << 30}, testTokens(3))
	c, ok := tab.Credit("conn-p", "p", 1<<30, epoch)
	require.True(t, ok)
	require.Equal(t, uint64(256<<10), c.Bytes())
}
