package reserve

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

var epoch = time.Unix(1_700_000_000, 0)

// testTokens is a deterministic token source, so runs replay exactly.
func testTokens(seed uint64) ids.TokenSource {
	var s [32]byte
	s[0] = byte(seed)
	return ids.ReaderTokens{R: rand.NewChaCha8(s)}
}

// harness drives a Table and remembers what it granted, so that scripts
// can name transfers instead of region ids and tokens.
type harness struct {
	tab      *Table
	slab     *slab.Slab
	now      time.Time
	grants   map[string]Grant // the first successful grant of each transfer
	items    map[string]Item
	terminal map[string]int // terminal events seen per transfer
	// held: content this shard announced with a Ready event and whose
	// Gone event has not come yet.
	held map[string]bool
}

func newHarness(slabBytes uint64, cfg Config) *harness {
	s := slab.NewSlab(slab.HostMemory(make([]byte, slabBytes)))
	// Scripts of room and eviction fill the slab from one requester; the
	// per-requester share is tested on its own (grant_test.go).
	if cfg.MaxPendingBytesPerOwner == 0 {
		cfg.MaxPendingBytesPerOwner = math.MaxUint64
	}
	return &harness{
		tab:      New(s, cfg, testTokens(1)),
		slab:     s,
		now:      epoch,
		grants:   map[string]Grant{},
		items:    map[string]Item{},
		terminal: map[string]int{},
		held:     map[string]bool{},
	}
}

// ev is the part of an Event a script states; the harness checks the rest
// against the item that was reserved.
type ev struct {
	tid    string
	ready  bool
	reason string
	gone   string // the mm_hash of a Gone event, which names no transfer
}

func shortEvent(e Event) ev {
	if e.Gone {
		return ev{gone: e.MMHash, reason: e.Reason}
	}
	return ev{tid: e.TransferID, ready: e.Ready, reason: e.Reason}
}

// gone is the end of the ready copy of each hash, for reason.
func gone(reason string, hashes ...string) []ev {
	out := make([]ev, len(hashes))
	for i, h := range hashes {
		out[i] = ev{gone: h, reason: reason}
	}
	return out
}

func ready(tids ...string) []ev {
	out := make([]ev, len(tids))
	for i, id := range tids {
		out[i] = ev{tid: id, ready: true}
	}
	return out
}

func failed(reason string, tids ...string) []ev {
	out := make([]ev, len(tids))
	for i, id := range tids {
		out[i] = ev{tid: id, reason: reason}
	}
	return out
}

// step is one call in a script. After every step the harness drains the
// events and compares them with events (nil: none), then checks the
// table's invariants.
type step struct {
	at time.Duration // now = epoch + at
	op string        // reserve begin end complete abandon cancel tick acquire release evict

	items    []Item
	tid      string    // the transfer whose write grant a writer op uses, or the one to cancel
	res      ids.ResID // overrides the grant's region id
	badToken bool
	hash     string
	off, n   uint64
	ok       bool
	reason   string

	err    error   // the sentinel the call must return, nil for success
	kinds  []Kind  // reserve: the kind of each grant (0 where it fails)
	errs   []error // reserve: the error of each grant (nil entries: success)
	events []ev
	check  func(t *testing.T, h *harness)
}

func (h *harness) run(t *testing.T, steps []step) {
	t.Helper()
	for i, st := range steps {
		h.now = epoch.Add(st.at)
		h.do(t, i, st)
		h.checkEvents(t, i, st.events)
		require.NoError(t, h.tab.CheckInvariants(), "step %d (%s)", i, st.op)
		if st.check != nil {
			st.check(t, h)
		}
	}
}

func (h *harness) writeArgs(st step) (ids.ResID, ids.Token) {
	g := h.grants[st.tid]
	res, tok := g.Res, g.Token
	if st.res != 0 {
		res = st.res
	}
	if st.badToken {
		tok[0] ^= 0xff
	}
	return res, tok
}

func (h *harness) do(t *testing.T, i int, st step) {
	t.Helper()
	var err error
	switch st.op {
	case "reserve":
		grants := h.tab.Reserve(st.items, h.now)
		require.Len(t, grants, len(st.items), "step %d", i)
		for j, g := range grants {
			it := st.items[j]
			require.Equal(t, it.TransferID, g.TransferID, "step %d item %d", i, j)
			if _, seen := h.items[it.TransferID]; !seen {
				h.items[it.TransferID] = it // a refusal has its event too
			}
			var wantErr error
			if st.errs != nil {
				wantErr = st.errs[j]
			}
			if wantErr != nil {
				require.ErrorIs(t, g.Err, wantErr, "step %d item %d", i, j)
				require.Zero(t, g.Kind)
				continue
			}
			require.NoError(t, g.Err, "step %d item %d", i, j)
			if st.kinds != nil {
				require.Equal(t, st.kinds[j], g.Kind, "step %d item %d", i, j)
			}
			require.Equal(t, it.NBytes, g.NBytes)
			require.Equal(t, g.Kind == KindWrite, g.Res != 0 && !g.Token.IsZero(), "Res and Token come only with a write")
			if prev, seen := h.grants[it.TransferID]; seen {
				require.Equal(t, prev, g, "step %d: a repeated reserve must repeat the grant", i)
			} else {
				h.grants[it.TransferID] = g
			}
		}
		return
	case "begin":
		res, tok := h.writeArgs(st)
		var off uint64
		off, err = h.tab.BeginWrite(res, tok, st.off, st.n, h.now)
		if err == nil {
			r := h.tab.regions[res]
			require.Equal(t, r.off+st.off, off, "step %d: a write lands at its offset in the region", i)
			_, verr := h.slab.View(off, st.n)
			require.NoError(t, verr, "step %d: an admitted write lies inside live memory", i)
		}
	case "end":
		res, _ := h.writeArgs(st)
		h.tab.EndWrite(res, st.ok, h.now)
		return
	case "complete":
		res, tok := h.writeArgs(st)
		err = h.tab.Complete(res, tok, h.now)
	case "abandon":
		res, tok := h.writeArgs(st)
		err = h.tab.Abandon(res, tok, st.reason, h.now)
	case "cancel":
		err = h.tab.Cancel(st.tid, h.now)
	case "tick":
		h.tab.Tick(h.now)
		return
	case "acquire":
		var off, n uint64
		off, n, err = h.tab.Acquire(st.hash, h.now)
		if err == nil {
			loff, ln, ok := h.tab.Lookup(st.hash)
			require.True(t, ok)
			require.Equal(t, [2]uint64{loff, ln}, [2]uint64{off, n})
		}
	case "release":
		err = h.tab.Release(st.hash, h.now)
	case "evict":
		h.tab.EvictResidents()
		return
	default:
		t.Fatalf("step %d: unknown op %q", i, st.op)
	}
	if st.err != nil {
		require.ErrorIs(t, err, st.err, "step %d (%s)", i, st.op)
	} else {
		require.NoError(t, err, "step %d (%s)", i, st.op)
	}
}

func (h *harness) checkEvents(t *testing.T, i int, want []ev) {
	t.Helper()
	got := h.tab.Ready().Events
	var gotShort []ev
	for _, e := range got {
		gotShort = append(gotShort, shortEvent(e))
		if e.Gone {
			require.Empty(t, e.TransferID, "step %d: a Gone event names no transfer", i)
			require.False(t, e.Ready, "step %d: a Gone event is not ready", i)
			require.Positive(t, e.NBytes, "step %d: a Gone event carries the copy's size", i)
			require.True(t, h.held[e.MMHash], "step %d: Gone for %s, which was not announced ready", i, e.MMHash)
			delete(h.held, e.MMHash)
			continue
		}
		if e.Ready {
			h.held[e.MMHash] = true
		}
		it := h.items[e.TransferID]
		require.Equal(t, it.MMHash, e.MMHash, "step %d: event for %s", i, e.TransferID)
		require.Equal(t, it.NBytes, e.NBytes, "step %d: event for %s", i, e.TransferID)
		h.terminal[e.TransferID]++
		require.Equal(t, 1, h.terminal[e.TransferID], "step %d: %s has more than one terminal event", i, e.TransferID)
	}
	require.Equal(t, want, gotShort, "step %d: events", i)
}

func (h *harness) status(t *testing.T, tid string) StatusInfo {
	t.Helper()
	s, ok := h.tab.Status(tid)
	require.True(t, ok, "status of %s", tid)
	return s
}
