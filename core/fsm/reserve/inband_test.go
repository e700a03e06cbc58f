package reserve

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// inband reserves one 4096-byte write of h for tid and returns its grant.
func inband(t *testing.T, h *harness, tid, hash string) Grant {
	t.Helper()
	g := h.tab.Reserve([]Item{item(tid, hash, 4096)}, h.now)[0]
	require.NoError(t, g.Err)
	require.Equal(t, KindWrite, g.Kind)
	h.tab.Ready()
	return g
}

// land admits and ends one frame [off, off+n) that carries the item's
// completion, and returns what ending it said.
func land(t *testing.T, h *harness, g Grant, off, n uint64) error {
	t.Helper()
	_, err := h.tab.BeginWrite(g.Res, g.Token, off, n, h.now)
	require.NoError(t, err)
	return h.tab.EndComplete(g.Res, g.Token, off, n, h.now)
}

func readyEvents(h *harness) []ev {
	var out []ev
	for _, e := range h.tab.Ready().Events {
		out = append(out, shortEvent(e))
	}
	return out
}

// The frames of one item land out of order on several connections; the
// item completes when the last byte lands, without a Complete call.
func TestInBandCompletesWhenEveryByteLanded(t *testing.T) {
	h := newHarness(1<<16, Config{Lease: lease})
	g := inband(t, h, "t1", "h1")
	// Two frames open at once, as on two connections.
	_, err := h.tab.BeginWrite(g.Res, g.Token, 2048, 2048, h.now)
	require.NoError(t, err)
	require.NoError(t, land(t, h, g, 0, 2048))
	require.Empty(t, readyEvents(h), "half the bytes landed: not complete")
	require.Equal(t, Writing, h.tab.regions[g.Res].state)
	require.NoError(t, h.tab.EndComplete(g.Res, g.Token, 2048, 2048, h.now))
	require.Equal(t, ready("t1"), readyEvents(h))
	require.Equal(t, Ready, h.tab.regions[g.Res].state)
	require.Equal(t, uint64(1), h.tab.Stats().Completed)
	require.NoError(t, h.tab.CheckInvariants())
}

// A frame sent twice must not stand in for bytes that never came: the
// region does not complete with a hole, and the overlap is counted.
func TestInBandReplayedFrameLeavesNoHole(t *testing.T) {
	h := newHarness(1<<16, Config{Lease: lease})
	g := inband(t, h, "t1", "h1")
	require.NoError(t, land(t, h, g, 0, 2048))
	err := land(t, h, g, 0, 2048)
	require.ErrorIs(t, err, ErrTorn)
	require.Empty(t, readyEvents(h))
	require.Equal(t, uint64(1), h.tab.Stats().InBandRefused)
	// The second half alone cannot finish a torn region either.
	require.ErrorIs(t, land(t, h, g, 2048, 2048), ErrTorn)
	require.Empty(t, readyEvents(h))
	// One write of the whole region mends it, as for any torn region.
	require.NoError(t, land(t, h, g, 0, 4096))
	require.Equal(t, ready("t1"), readyEvents(h))
	require.NoError(t, h.tab.CheckInvariants())
}

// A frame replayed after the item completed finds the region no longer
// writable; an in-band end for a write never begun, or with another
// region's token, is refused, counted and completes nothing.
func TestInBandReplayAfterCompleteAndForgedEnds(t *testing.T) {
	h := newHarness(1<<16, Config{Lease: lease})
	g := inband(t, h, "t1", "h1")
	o := inband(t, h, "t2", "h2")
	require.ErrorIs(t, h.tab.EndComplete(g.Res, g.Token, 0, 4096, h.now), ErrNoWrite, "an end with no write begun")
	_, err := h.tab.BeginWrite(g.Res, g.Token, 0, 4096, h.now)
	require.NoError(t, err)
	require.ErrorIs(t, h.tab.EndComplete(g.Res, o.Token, 0, 4096, h.now), ErrBadToken)
	require.Empty(t, readyEvents(h), "a forged end completes nothing")
	require.Equal(t, Writing, h.tab.regions[g.Res].state)
	require.NoError(t, land(t, h, g, 0, 4096), "a whole rewrite mends the region")
	require.Equal(t, ready("t1"), readyEvents(h))
	_, err = h.tab.BeginWrite(g.Res, g.Token, 0, 4096, h.now)
	require.ErrorIs(t, err, ErrNotWritable, "a replay after completion")
	require.Equal(t, Writing, h.tab.regions[o.Res].state)
	st := h.tab.Stats()
	require.Equal(t, uint64(1), st.RejectedWrites.NotWritable)
	require.Equal(t, uint64(2), st.InBandRefused)
	require.NoError(t, h.tab.CheckInvariants())
}

// Islands of landed bytes are bounded: a writer that scatters more than
// maxLanded disjoint frames over a region tears it instead of growing the
// table.
func TestInBandScatteredFramesBounded(t *testing.T) {
	h := newHarness(1<<20, Config{Lease: lease})
	g := h.tab.Reserve([]Item{item("t1", "h1", 4*(maxLanded+1))}, h.now)[0]
	require.NoError(t, g.Err)
	var err error
	for i := uint64(0); i <= maxLanded && err == nil; i++ {
		err = land(t, h, g, 4*i, 1)
	}
	require.ErrorIs(t, err, ErrTorn)
	require.LessOrEqual(t, len(h.tab.regions[g.Res].landed), maxLanded)
	require.Equal(t, uint64(1), h.tab.Stats().InBandRefused)
	require.NoError(t, h.tab.CheckInvariants())
}

// A producer killed between its frames: the bytes that landed complete
// nothing, and the lease gives the region back to the slab.
func TestInBandWriterKilledMidItemLeaseFrees(t *testing.T) {
	h := newHarness(1<<16, Config{Lease: lease})
	g := inband(t, h, "t1", "h1")
	require.NoError(t, land(t, h, g, 0, 1024))
	_, err := h.tab.BeginWrite(g.Res, g.Token, 1024, 1024, h.now)
	require.NoError(t, err)
	h.tab.EndWrite(g.Res, false, h.now) // its connection died mid-frame
	require.Empty(t, readyEvents(h))
	h.now = h.now.Add(lease)
	h.tab.Tick(h.now)
	require.Equal(t, []ev{{tid: "t1", reason: ReasonExpired}}, readyEvents(h))
	require.Zero(t, h.slab.InUse())
	require.NoError(t, h.tab.CheckInvariants())
}

// The last frame lands after the lease ran out: the bytes are taken (the
// region waited for them), but the item is not made ready and the end
// says why, so the writer learns its push failed.
func TestInBandLastFrameAfterLease(t *testing.T) {
	h := newHarness(1<<16, Config{Lease: lease})
	g := inband(t, h, "t1", "h1")
	_, err := h.tab.BeginWrite(g.Res, g.Token, 0, 4096, h.now)
	require.NoError(t, err)
	h.now = h.now.Add(lease)
	h.tab.Tick(h.now)
	require.Equal(t, []ev{{tid: "t1", reason: ReasonExpired}}, readyEvents(h))
	require.ErrorIs(t, h.tab.EndComplete(g.Res, g.Token, 0, 4096, h.now), ErrGone)
	require.Empty(t, readyEvents(h))
	require.Zero(t, h.slab.InUse())
	require.NoError(t, h.tab.CheckInvariants())
}
