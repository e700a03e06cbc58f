package reserve

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

// TestRandomizedModel mixes every operation at random (fixed seed) and
// checks after each step: the table's invariants, that no transfer ever
// gets a second terminal event, and that admitted writes stay inside their
// region. At the end it winds everything down and expects every transfer
// to have had exactly one terminal event and the slab to be empty.
//
// The second shape gives room for every content to stay resident, so that
// eviction has many copies to choose among (roomFor is checked against its
// full search at every step).
func TestRandomizedModel(t *testing.T) {
	shapes := []modelShape{
		{"tight", 32 << 10, 12 << 10},
		{"many residents", 64 << 10, 60 << 10},
	}
	for _, sh := range shapes {
		searches := 0
		for seed := range uint64(4) {
			t.Run(fmt.Sprint(sh.name, "/seed", seed), func(t *testing.T) { searches += runModel(t, seed, 4000, sh) })
		}
		if sh.name == "many residents" {
			require.Positive(t, searches, "roomFor never chose among several residents")
		}
	}
}

// modelShape sizes the model's slab and the resident bytes it may keep.
type modelShape struct {
	name              string
	slab, maxResident uint64
}

// admitted is a write that BeginWrite accepted and EndWrite has not ended.
type admitted struct {
	res    ids.ResID
	tok    ids.Token
	off, n uint64
}

// runModel returns how many of roomFor's checks chose among several
// residents.
func runModel(t *testing.T, seed uint64, steps int, shape modelShape) (searches int) {
	rng := rand.New(rand.NewPCG(seed, 99))
	h := newHarness(shape.slab, Config{Lease: lease, MaxResidentBytes: shape.maxResident})
	hashes := []string{"h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7"}
	size := func(hash string) uint64 { return uint64(hash[1]-'0'+1) * 1500 }
	granted := map[string]bool{}
	var tids []string
	var inflight []admitted
	pins := map[string]int{}
	next := 0
	seen := map[string]int{} // what the run reached, so that it cannot pass by doing nothing

	pickTid := func() string {
		if len(tids) == 0 || rng.IntN(10) == 0 {
			return "nobody"
		}
		return tids[rng.IntN(len(tids))]
	}
	var writers []string
	pickWrite := func() Grant {
		tid := pickTid()
		if len(writers) > 0 && rng.IntN(10) > 0 {
			tid = writers[rng.IntN(len(writers))]
		}
		g := h.grants[tid]
		if rng.IntN(20) == 0 {
			g.Token[3] ^= 1
		}
		if rng.IntN(30) == 0 {
			g.Res = ids.ResID(rng.IntN(int(h.tab.lastRes) + 3))
		}
		return g
	}

	for i := range steps {
		h.now = h.now.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
		op := rng.IntN(100)
		switch {
		case op < 20:
			var items []Item
			for range 1 + rng.IntN(3) {
				var tid string
				if len(tids) > 0 && rng.IntN(8) == 0 {
					tid = tids[rng.IntN(len(tids))]
				} else {
					tid = fmt.Sprint("t", next)
					next++
				}
				hash := hashes[rng.IntN(len(hashes))]
				n := size(hash)
				if rng.IntN(40) == 0 {
					n++
				}
				if it, ok := h.items[tid]; ok && rng.IntN(4) > 0 {
					hash, n = it.MMHash, it.NBytes
				}
				// Two requesters on a connection each: a connection's end
				// (PeerGone, below) lets the other take a write over.
				owner := fmt.Sprint("o", rng.IntN(2))
				items = append(items, Item{TransferID: tid, MMHash: hash, NBytes: n, Owner: owner, Peer: "conn-" + owner})
			}
			takenBefore := h.tab.Stats().TakenOver
			for j, g := range h.tab.Reserve(items, h.now) {
				if g.Err != nil {
					if _, ok := h.items[items[j].TransferID]; !ok {
						h.items[items[j].TransferID] = items[j] // a refusal for room has its event
					}
					continue
				}
				tid := items[j].TransferID
				if prev, ok := h.grants[tid]; ok {
					if g.Kind == KindWrite && g.Res != prev.Res {
						// The write of an orphaned transfer, taken over by
						// another requester: a new region of its own.
						require.Greater(t, h.tab.Stats().TakenOver, takenBefore, "step %d: a new grant for a known transfer", i)
						h.grants[tid] = g
						writers = append(writers, tid)
						continue
					}
					if prev.Kind == KindWrite && g.Kind == KindFollow {
						// Its write was taken over under another id: it
						// follows that write now.
						require.Positive(t, h.tab.Stats().TakenOver, "step %d: a writer turned follower", i)
						continue
					}
					require.Equal(t, prev, g, "step %d: a repeated reserve repeats the grant", i)
					continue
				}
				seen[g.Kind.String()]++
				h.grants[tid], h.items[tid], granted[tid] = g, items[j], true
				tids = append(tids, tid)
				if g.Kind == KindWrite {
					writers = append(writers, tid)
				}
			}
			if h.tab.Stats().TakenOver > takenBefore {
				seen["taken over"]++
			}
		case op < 40:
			g := pickWrite()
			n := uint64(rng.IntN(int(g.NBytes) + 2))
			off := uint64(0)
			if rng.IntN(2) == 0 && g.NBytes > 0 {
				off = uint64(rng.IntN(int(g.NBytes)))
				n = min(n, g.NBytes-off)
			}
			slabOff, err := h.tab.BeginWrite(g.Res, g.Token, off, n, h.now)
			if err == nil {
				r := h.tab.regions[g.Res]
				require.Equal(t, Writing, r.state)
				require.True(t, slabOff >= r.off && slabOff+n <= r.off+r.nbytes, "step %d: write outside its region", i)
				inflight = append(inflight, admitted{g.Res, g.Token, off, n})
			}
		case op < 55:
			if len(inflight) > 0 {
				k := rng.IntN(len(inflight))
				w := inflight[k]
				switch rng.IntN(12) {
				case 0, 1, 2, 3, 4, 5:
					// A frame that carries its item's completion (TCP).
					// It ends its write (the invariants below check the
					// count) and may complete the region; its refusals
					// are only these.
					requireKnown(t, h.tab.EndComplete(w.res, w.tok, w.off, w.n, h.now), ErrGone, ErrTorn)
				case 6:
					h.tab.EndWrite(w.res, false, h.now)
				default:
					h.tab.EndWrite(w.res, true, h.now)
				}
				inflight = append(inflight[:k], inflight[k+1:]...)
			}
		case op < 68:
			g := pickWrite()
			err := h.tab.Complete(g.Res, g.Token, h.now)
			requireKnown(t, err, ErrUnknown, ErrGone, ErrBadToken, ErrWritesInFlight, ErrTorn)
			if err == nil {
				seen["complete"]++
			}
		case op < 72:
			g := pickWrite()
			err := h.tab.Abandon(g.Res, g.Token, "model", h.now)
			requireKnown(t, err, ErrUnknown, ErrGone, ErrBadToken, ErrNotWritable)
		case op < 78:
			err := h.tab.Cancel(pickTid(), h.now)
			requireKnown(t, err, ErrUnknown)
		case op < 84:
			if rng.IntN(4) == 0 {
				h.now = h.now.Add(lease)
			}
			h.tab.Tick(h.now)
		case op < 92:
			hash := hashes[rng.IntN(len(hashes))]
			if _, _, err := h.tab.Acquire(hash, h.now); err == nil {
				pins[hash]++
			} else {
				requireKnown(t, err, ErrUnknown, ErrNotReady)
			}
		case op < 99:
			hash := hashes[rng.IntN(len(hashes))]
			err := h.tab.Release(hash, h.now)
			if pins[hash] > 0 {
				require.NoError(t, err, "step %d", i)
				pins[hash]--
			} else {
				require.ErrorIs(t, err, ErrNotPinned, "step %d", i)
			}
		case op < 100 && rng.IntN(2) == 0:
			if h.tab.PeerGone(fmt.Sprint("conn-o", rng.IntN(2)), h.now) > 0 {
				seen["orphaned"]++
			}
		default:
			h.tab.EvictResidents()
		}
		h.checkEvents(t, i, h.peekEvents())
		require.NoError(t, h.tab.CheckInvariants(), "step %d", i)
		searches += checkRoomFor(t, h.tab, i)
		st := h.tab.Stats()
		seen["pending"] += st.Pending
		seen["resident"] += st.Residents
		seen["pinned"] += st.Pinned
	}
	for _, what := range []string{"write", "follow", "cached", "complete", "pending", "resident", "pinned", "orphaned", "taken over"} {
		require.Positive(t, seen[what], "the run never reached %q", what)
	}

	// Wind down: every write ends, every pin is released, every transfer
	// is cancelled, residents go and every lease runs out.
	for _, w := range inflight {
		h.tab.EndWrite(w.res, true, h.now)
	}
	for hash, n := range pins {
		for range n {
			require.NoError(t, h.tab.Release(hash, h.now))
		}
	}
	for _, tid := range tids {
		require.NoError(t, h.tab.Cancel(tid, h.now))
	}
	h.tab.EvictResidents()
	h.tab.Tick(h.now.Add(10 * lease))
	h.checkEvents(t, steps, h.peekEvents())
	require.NoError(t, h.tab.CheckInvariants())
	require.Zero(t, h.slab.InUse())
	require.Empty(t, h.tab.regions)
	require.Empty(t, h.tab.transfers)
	for tid := range granted {
		require.Equal(t, 1, h.terminal[tid], "transfer %s must end with exactly one terminal event", tid)
	}
	require.Empty(t, h.held, "every copy announced ready must end with a Gone event once its region is gone")
	s := h.tab.Stats()
	require.Positive(t, s.Evictions, "the run never evicted")
	require.Positive(t, s.Expired-s.Evictions, "the run never expired a lease")
	require.Positive(t, s.Cancelled, "the run never cancelled")
	return searches
}

// peekEvents returns the pending events as the harness's short form, so the
// model can hand them to checkEvents, which drains and counts them.
func (h *harness) peekEvents() []ev {
	var out []ev
	for _, e := range h.tab.events {
		out = append(out, shortEvent(e))
	}
	return out
}

func requireKnown(t *testing.T, err error, allowed ...error) {
	t.Helper()
	if err == nil {
		return
	}
	for _, a := range allowed {
		if errors.Is(err, a) {
			return
		}
	}
	t.Fatalf("unexpected error: %v", err)
}

// checkRoomFor holds roomFor's shortcut (the least recently used copy
// alone, when it is large enough) to the full search, for sizes below,
// at and above the model's items.
func checkRoomFor(t *testing.T, tab *Table, step int) (searches int) {
	if tab.residents.Len() == 0 {
		return 0
	}
	for _, n := range []uint64{1, 1500, 2999, 4500, 7500, 12000} {
		need := (n + slab.Align - 1) &^ (slab.Align - 1)
		if need > tab.slab.Size()-tab.slab.InUse()+tab.residentBytes {
			continue
		}
		want, got := tab.roomForScan(need), tab.roomFor(n)
		if !slices.Equal(want, got) {
			require.Equal(t, want, got, "step %d: roomFor(%d)", step, n)
		}
		if tab.residents.Len() > 1 && want != nil {
			searches++
		}
	}
	return searches
}
