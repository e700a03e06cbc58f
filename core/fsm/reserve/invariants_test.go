package reserve

import (
	"bytes"
	"errors"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

// TestCheckInvariantsCatchesCorruption makes sure the checker the other
// tests lean on can fail: each case breaks one rule on a healthy table.
func TestCheckInvariantsCatchesCorruption(t *testing.T) {
	setup := func(t *testing.T) (*harness, *region, *region) {
		h := newHarness(16<<10, Config{Lease: lease, MaxTombstones: 8})
		h.run(t, []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f", "h1", 1000), item("r", "h2", 1000)}},
			{op: "complete", tid: "r", events: ready("r")},
			{op: "acquire", hash: "h2"},
			{op: "release", hash: "h2"},
			{op: "reserve", items: []Item{item("x", "h3", 1000)}},
			{op: "cancel", tid: "x", events: failed(ReasonCancelled, "x")},
		})
		return h, h.tab.regions[h.grants["w"].Res], h.tab.regions[h.grants["r"].Res]
	}
	tests := []struct {
		name    string
		corrupt func(h *harness, writing, resident *region)
	}{
		{"internal fault", func(h *harness, _, _ *region) { h.tab.fault(errors.New("boom")) }},
		{"negative writes in flight", func(h *harness, w, _ *region) { w.inflight = -1 }},
		{"pending without writes", func(h *harness, w, _ *region) { w.state = CancelPending }},
		{"pinned while writing", func(h *harness, w, _ *region) { w.pins = 1 }},
		{"resident outside the LRU", func(h *harness, _, r *region) { h.tab.residents.Remove(r.lru); r.lru = nil }},
		{"lost from the hash index", func(h *harness, w, _ *region) { delete(h.tab.byHash, "h1") }},
		{"slab bytes nobody owns", func(h *harness, _, _ *region) { _, _ = h.slab.Alloc(1) }},
		{"region size beyond its allocation", func(h *harness, w, _ *region) { w.nbytes = 5000 }},
		{"transfer on a dead region", func(h *harness, w, _ *region) { h.tab.transfers["f"].region = &region{res: 77} }},
		{"live and a tombstone", func(h *harness, _, _ *region) {
			h.tab.tomb.addTransfer("w", transferTomb{mmHash: "h1"})
		}},
		{"writing for no transfer", func(h *harness, w, _ *region) {
			delete(h.tab.transfers, "w")
			delete(h.tab.transfers, "f")
			w.writer, w.followers = nil, nil
		}},
		{"lease on a loaded region", func(h *harness, _, r *region) { r.deadline = epoch }},
		{"tombstones over the bound", func(h *harness, _, _ *region) { h.tab.tomb.max = 1 }},
		{"cached transfer left live", func(h *harness, w, _ *region) { h.tab.transfers["f"].kind = KindCached }},
		{"landed runs overlapping", func(h *harness, w, _ *region) { w.landed = []span{{0, 10}, {5, 20}} }},
		{"landed run past the region", func(h *harness, w, _ *region) { w.landed = []span{{0, 1001}} }},
		{"landed runs kept once ready", func(h *harness, _, r *region) { r.landed = []span{{0, 10}} }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, w, r := setup(t)
			require.NoError(t, h.tab.CheckInvariants())
			tc.corrupt(h, w, r)
			require.Error(t, h.tab.CheckInvariants())
		})
	}
}

func TestTokenSourceFailureFailsOnlyThatItem(t *testing.T) {
	s := slab.NewSlab(slab.HostMemory(make([]byte, 4096)))
	one := bytes.Repeat([]byte{1}, ids.TokenLen)
	tab := New(s, Config{}, ids.ReaderTokens{R: bytes.NewReader(one)})
	g := tab.Reserve([]Item{item("a", "h1", 100), item("b", "h2", 100), item("c", "h1", 100)}, epoch)
	require.NoError(t, g[0].Err)
	require.Error(t, g[1].Err)
	require.Equal(t, KindFollow, g[2].Kind)
	require.Equal(t, uint64(256), s.InUse(), "a failed item holds no memory")
	require.NoError(t, tab.CheckInvariants())
}

func TestReserveOnAClosingSlab(t *testing.T) {
	s := slab.NewSlab(slab.HostMemory(make([]byte, 4096)))
	tab := New(s, Config{Lease: lease}, testTokens(3))
	g := tab.Reserve([]Item{item("a", "h1", 100)}, epoch)
	require.NoError(t, g[0].Err)
	require.NoError(t, s.Close(true))
	g = tab.Reserve([]Item{item("b", "h2", 100), item("c", "h1", 100)}, epoch)
	require.ErrorIs(t, g[0].Err, slab.ErrClosed)
	require.NotErrorIs(t, g[0].Err, ErrPoolFull)
	require.Equal(t, KindFollow, g[1].Kind, "joining an existing region needs no memory")
	require.NoError(t, tab.Cancel("a", epoch))
	require.NoError(t, tab.Cancel("c", epoch))
	require.Equal(t, slab.Closed, s.State(), "the last region freed closes the slab")
	require.NoError(t, tab.CheckInvariants())
	require.Equal(t, []Event{
		{TransferID: "b", MMHash: "h2", NBytes: 100, Reason: "refused: " + g[0].Err.Error()},
		{TransferID: "a", MMHash: "h1", NBytes: 100, Reason: ReasonCancelled},
		{TransferID: "c", MMHash: "h1", NBytes: 100, Reason: ReasonCancelled},
	}, tab.Ready().Events)
}
