package reserve

import (
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const lease = time.Minute

func item(tid, hash string, n uint64) Item { return Item{TransferID: tid, MMHash: hash, NBytes: n} }

func inUse(want uint64) func(*testing.T, *harness) {
	return func(t *testing.T, h *harness) {
		t.Helper()
		require.Equal(t, want, h.slab.InUse(), "slab bytes in use")
	}
}

func regionState(tid string, want State) func(*testing.T, *harness) {
	return func(t *testing.T, h *harness) {
		t.Helper()
		r := h.tab.regions[h.grants[tid].Res]
		require.NotNil(t, r, "region of %s is not live", tid)
		require.Equal(t, want, r.state)
	}
}

func statusIs(tid string, want StatusInfo) func(*testing.T, *harness) {
	return func(t *testing.T, h *harness) {
		t.Helper()
		require.Equal(t, want, h.status(t, tid))
	}
}

func all(checks ...func(*testing.T, *harness)) func(*testing.T, *harness) {
	return func(t *testing.T, h *harness) {
		t.Helper()
		for _, c := range checks {
			c(t, h)
		}
	}
}

// fragmented fills an 8192-byte slab with eight 1024-byte regions h1..h8,
// pins h3 and h6 (loaded, so neither evictable) and makes the others
// resident copies, released in the order given (oldest first), then runs
// more. The slab is then: [h1 h2] h3 [h4 h5] h6 [h7 h8].
func fragmented(order []string, more ...step) []step {
	var steps []step
	var items []Item
	for i := 1; i <= 8; i++ {
		items = append(items, item("t"+strconv.Itoa(i), "h"+strconv.Itoa(i), 1024))
	}
	steps = append(steps, step{op: "reserve", items: items})
	for i := 1; i <= 8; i++ {
		steps = append(steps, step{op: "complete", tid: "t" + strconv.Itoa(i), events: ready("t" + strconv.Itoa(i))})
	}
	steps = append(steps, step{op: "acquire", hash: "h3"}, step{op: "acquire", hash: "h6"})
	for _, h := range order {
		steps = append(steps, step{op: "acquire", hash: h}, step{op: "release", hash: h})
	}
	return append(steps, more...)
}

func TestScenarios(t *testing.T) {
	tests := []struct {
		name  string
		slab  uint64
		cfg   Config
		steps []step
	}{
		{name: "writer and two followers complete", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000), item("f2", "h1", 1000)},
				kinds: []Kind{KindWrite, KindFollow, KindFollow}, check: inUse(1024)},
			{op: "begin", tid: "w", off: 0, n: 600},
			{op: "begin", tid: "w", off: 600, n: 400},
			{op: "complete", tid: "w", err: ErrWritesInFlight},
			{op: "end", tid: "w", ok: true},
			{op: "end", tid: "w", ok: true},
			{op: "complete", tid: "w", events: ready("w", "f1", "f2"), check: all(
				statusIs("f1", StatusInfo{MMHash: "h1", State: Ready, Kind: KindFollow, NBytes: 1000, Done: true}),
				statusIs("w", StatusInfo{MMHash: "h1", State: Ready, Kind: KindWrite, NBytes: 1000, Done: true}),
				func(t *testing.T, h *harness) { require.Equal(t, 1, h.tab.Stats().Transfers, "followers are settled") },
			)},
			{op: "complete", tid: "w"},
			{op: "acquire", hash: "h1"},
			{op: "release", hash: "h1", check: func(t *testing.T, h *harness) {
				s := h.tab.Stats()
				require.Equal(t, 1, s.Residents)
				require.Equal(t, uint64(1024), s.ResidentBytes)
			}},
			{op: "evict", events: gone(ReasonEvicted, "h1"), check: inUse(0)},
		}},
		{name: "writer abandons and followers fail at once", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000)}, kinds: []Kind{KindWrite, KindFollow}},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{op: "abandon", tid: "w", reason: "encoder oom", events: failed("abandoned: encoder oom", "w", "f1"),
				check: all(regionState("w", CancelPending), inUse(1024),
					statusIs("f1", StatusInfo{MMHash: "h1", State: Cancelled, Kind: KindFollow, NBytes: 1000, Done: true, Reason: "abandoned: encoder oom"}))},
			{op: "abandon", tid: "w"},
			{op: "complete", tid: "w", err: ErrGone},
			{op: "end", tid: "w", ok: true, check: inUse(0)},
			{op: "begin", tid: "w", off: 0, n: 1, err: ErrGone},
			{op: "abandon", tid: "w", err: ErrGone},
			{op: "cancel", tid: "f1"},
		}},
		{name: "abandon with nothing in flight frees at once", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "abandon", tid: "w", events: failed(ReasonAbandoned, "w"), check: inUse(0)},
		}},
		{name: "abandon with a bad token or after complete", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "abandon", tid: "w", badToken: true, err: ErrBadToken},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "abandon", tid: "w", err: ErrNotWritable},
		}},
		{name: "cancel during a write keeps memory until the write ends", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 500},
			{op: "cancel", tid: "w", events: failed(ReasonCancelled, "w"), check: all(regionState("w", CancelPending), inUse(1024))},
			{op: "begin", tid: "w", off: 500, n: 500, err: ErrNotWritable},
			{op: "end", tid: "w", ok: true, check: all(inUse(0), func(t *testing.T, h *harness) {
				require.Equal(t, uint64(1), h.tab.Stats().Cancelled)
			})},
			{op: "cancel", tid: "w"},
			{op: "begin", tid: "w", off: 500, n: 500, err: ErrGone},
			{op: "complete", tid: "w", err: ErrGone},
			{op: "reserve", items: []Item{item("w", "h1", 1000)}, errs: []error{ErrGone}},
		}},
		{name: "cancel of the writer while followers wait: the writer may still finish", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000)}},
			{op: "cancel", tid: "w", events: failed(ReasonCancelled, "w"), check: regionState("w", Writing)},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{op: "end", tid: "w", ok: true},
			{op: "complete", tid: "w", events: ready("f1")},
			{op: "cancel", tid: "f1"},
			{op: "acquire", hash: "h1"},
		}},
		{name: "cancel of the last transfer ends the region", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000), item("f2", "h1", 1000)}},
			{op: "cancel", tid: "f1", events: failed(ReasonCancelled, "f1"), check: regionState("w", Writing)},
			{op: "cancel", tid: "w", events: failed(ReasonCancelled, "w"), check: regionState("w", Writing)},
			{op: "begin", tid: "w", off: 0, n: 10},
			{op: "cancel", tid: "f2", events: failed(ReasonCancelled, "f2"), check: all(regionState("w", CancelPending), inUse(1024))},
			{op: "end", tid: "w", ok: true, check: inUse(0)},
			{op: "cancel", tid: "nobody", err: ErrUnknown},
		}},
		{name: "cancel of a ready region that nobody else wants frees it", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "cancel", tid: "w", events: gone(ReasonCancelled, "h1"), check: all(inUse(0),
				statusIs("w", StatusInfo{MMHash: "h1", State: Cancelled, Kind: KindWrite, NBytes: 1000, Done: true, Reason: ReasonCancelled}))},
			{op: "acquire", hash: "h1", err: ErrUnknown},
		}},
		{name: "cancel of a shared ready region only detaches", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "reserve", items: []Item{item("c", "h1", 1000)}, kinds: []Kind{KindCached}, events: ready("c")},
			{op: "cancel", tid: "w", check: all(inUse(1024),
				statusIs("w", StatusInfo{MMHash: "h1", State: Ready, Kind: KindWrite, NBytes: 1000, Done: true}))},
			{op: "acquire", hash: "h1"},
		}},
		{name: "cancel of a loaded region only detaches", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "acquire", hash: "h1"},
			{op: "cancel", tid: "w", check: inUse(1024)},
			{op: "release", hash: "h1"},
			{op: "acquire", hash: "h1"},
		}},
		{name: "lease expiry with no write in flight", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000)}, check: func(t *testing.T, h *harness) {
				d, ok := h.tab.NextDeadline()
				require.True(t, ok)
				require.Equal(t, epoch.Add(lease), d)
			}},
			{at: lease - time.Nanosecond, op: "tick", check: regionState("w", Writing)},
			{at: lease, op: "tick", events: failed(ReasonExpired, "w", "f1"), check: all(inUse(0), func(t *testing.T, h *harness) {
				_, ok := h.tab.NextDeadline()
				require.False(t, ok)
				require.Equal(t, uint64(1), h.tab.Stats().Expired)
			})},
			{at: lease, op: "complete", tid: "w", err: ErrGone},
			{at: lease, op: "begin", tid: "w", off: 0, n: 1, err: ErrGone},
		}},
		{name: "lease expiry with a write in flight waits for it", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f1", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{at: 2 * lease, op: "tick", events: failed(ReasonExpired, "w", "f1"), check: all(
				regionState("w", ExpirePending), inUse(1024), func(t *testing.T, h *harness) {
					s := h.tab.Stats()
					require.Equal(t, 1, s.Pending)
					require.Equal(t, 1, s.Regions[ExpirePending])
					require.Equal(t, 1, s.WritesInFlight)
					_, ok := h.tab.NextDeadline()
					require.False(t, ok, "a pending region waits for its writes, not for a clock")
				})},
			{at: 3 * lease, op: "tick", check: regionState("w", ExpirePending)},
			{at: 3 * lease, op: "complete", tid: "w", err: ErrGone},
			{at: 3 * lease, op: "end", tid: "w", ok: true, check: all(inUse(0), func(t *testing.T, h *harness) {
				require.Equal(t, uint64(1), h.tab.Stats().Expired)
			})},
		}},
		{name: "abandon while an expiry is pending ends cancelled", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{at: lease, op: "tick", events: failed(ReasonExpired, "w")},
			{at: lease, op: "abandon", tid: "w", reason: "gave up"},
			{at: lease, op: "end", tid: "w", ok: false, check: all(inUse(0), func(t *testing.T, h *harness) {
				s := h.tab.Stats()
				require.Equal(t, uint64(1), s.Cancelled)
				require.Zero(t, s.Expired)
			})},
		}},
		{name: "a ready region never loaded expires; a loaded one does not", steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1000), item("b", "h2", 1000)}},
			{at: 10 * time.Second, op: "complete", tid: "a", events: ready("a")},
			{at: 10 * time.Second, op: "complete", tid: "b", events: ready("b")},
			{at: 10 * time.Second, op: "acquire", hash: "h2"},
			{at: 10*time.Second + lease - 1, op: "tick", check: inUse(2048)},
			{at: 10*time.Second + lease, op: "tick", events: gone(ReasonExpired, "h1"), check: all(inUse(1024),
				statusIs("a", StatusInfo{MMHash: "h1", State: Expired, Kind: KindWrite, NBytes: 1000, Done: true, Reason: ReasonExpired}))},
			{at: 100 * lease, op: "release", hash: "h2"},
			{at: 200 * lease, op: "tick", check: inUse(1024)},
			{at: 200 * lease, op: "acquire", hash: "h2"},
		}},
		{name: "a cached answer restarts the lease of a ready region", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", events: ready("w")},
			{at: lease / 2, op: "reserve", items: []Item{item("c", "h1", 1000)}, kinds: []Kind{KindCached}, events: ready("c")},
			{at: lease, op: "tick", check: inUse(1024)},
			{at: lease/2 + lease, op: "tick", events: gone(ReasonExpired, "h1"), check: inUse(0)},
		}},
		{name: "duplicate and late completes", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", badToken: true, err: ErrBadToken},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "complete", tid: "w"},
			{op: "complete", tid: "w", badToken: true, err: ErrBadToken},
			{op: "begin", tid: "w", off: 0, n: 1, err: ErrNotWritable},
			{op: "cancel", tid: "w", events: gone(ReasonCancelled, "h1"), check: inUse(0)},
			{op: "complete", tid: "w", err: ErrGone},
			{op: "complete", tid: "w", res: 99, err: ErrUnknown},
		}},
		{name: "a torn region must be rewritten whole", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 500},
			{op: "begin", tid: "w", off: 500, n: 500},
			{op: "end", tid: "w", ok: true},
			{op: "end", tid: "w", ok: false},
			{op: "complete", tid: "w", err: ErrTorn},
			{op: "begin", tid: "w", off: 500, n: 500},
			{op: "end", tid: "w", ok: true},
			{op: "complete", tid: "w", err: ErrTorn},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{op: "end", tid: "w", ok: true},
			{op: "complete", tid: "w", events: ready("w")},
		}},
		{name: "a torn region can be abandoned", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 1000},
			{op: "end", tid: "w", ok: false},
			{op: "abandon", tid: "w", events: failed(ReasonAbandoned, "w"), check: inUse(0)},
		}},
		{name: "out-of-bounds and overflowing writes", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 1001, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: 1000, n: 1, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: 1001, n: 0, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: 0, n: 0, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: 1, n: math.MaxUint64, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: math.MaxUint64, n: 2, err: ErrOutOfBounds},
			{op: "begin", tid: "w", off: 999, n: 1},
			{op: "end", tid: "w", ok: true, check: func(t *testing.T, h *harness) {
				require.Equal(t, Rejections{OutOfBounds: 6}, h.tab.Stats().RejectedWrites)
			}},
		}},
		{name: "bad tokens and unknown regions", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "begin", tid: "w", off: 0, n: 10, badToken: true, err: ErrBadToken},
			{op: "begin", tid: "nobody", res: 1, off: 0, n: 10, err: ErrBadToken},
			{op: "begin", tid: "w", res: 2, off: 0, n: 10, err: ErrUnknown},
			{op: "begin", tid: "nobody", off: 0, n: 10, err: ErrUnknown},
			{op: "end", tid: "w", ok: true, check: func(t *testing.T, h *harness) {
				s := h.tab.Stats()
				require.Equal(t, Rejections{BadToken: 2, Unknown: 2}, s.RejectedWrites)
				require.Equal(t, uint64(1), s.UnmatchedEnds)
			}},
			{op: "complete", tid: "w", events: ready("w")},
		}},
		{name: "pool full names the sizes and tells the scheduler at once", slab: 4096, steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 3000), item("b", "h2", 2000), item("c", "h3", 1000)},
				kinds: []Kind{KindWrite, 0, KindWrite}, errs: []error{nil, ErrPoolFull, nil},
				events: failed("refused: reserve transfer b (h2): pool full (2000 bytes asked, 3072 of 4096 bytes in use, largest free extent 1024 bytes)", "b"),
				check: statusIs("b", StatusInfo{MMHash: "h2", State: Cancelled, NBytes: 2000, Done: true,
					Reason: "refused: reserve transfer b (h2): pool full (2000 bytes asked, 3072 of 4096 bytes in use, largest free extent 1024 bytes)"})},
			// The refusal stands for that transfer, with no second event.
			{op: "reserve", items: []Item{item("b", "h2", 2000)}, errs: []error{ErrGone}},
			{op: "reserve", items: []Item{item("d", "h4", 2000)}, errs: []error{ErrPoolFull}, check: func(t *testing.T, h *harness) {
				require.Equal(t, "reserve transfer d (h4): pool full (2000 bytes asked, 4096 of 4096 bytes in use, largest free extent 0 bytes)", h.status(t, "d").Reason[len("refused: "):])
			}, events: failed("refused: reserve transfer d (h4): pool full (2000 bytes asked, 4096 of 4096 bytes in use, largest free extent 0 bytes)", "d")},
		}},
		{name: "fragmented slab: only residents that open a large enough extent are evicted", slab: 8192, steps: fragmented(
			// LRU, oldest first: h1 h4 h7 h2 h5 h8. Evicting by age alone
			// would take h1 h4 h7 h2 (four copies) before h1+h2 fit; the
			// adjacent pair h1 h2 is enough.
			[]string{"h1", "h4", "h7", "h2", "h5", "h8"},
			step{op: "reserve", items: []Item{item("x", "h9", 2048)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h1", "h2"), check: func(t *testing.T, h *harness) {
				require.Equal(t, uint64(2), h.tab.Stats().Evictions)
				for hash, want := range map[string]bool{"h1": false, "h2": false, "h4": true, "h5": true, "h7": true, "h8": true} {
					_, _, ok := h.tab.Lookup(hash)
					require.Equal(t, want, ok, hash)
				}
				require.Equal(t, uint64(0), h.grants["x"].Offset, "the extent the evictions opened")
			}},
		)},
		{name: "fragmented slab: among extents, the one of the least recently used copies", slab: 8192, steps: fragmented(
			[]string{"h2", "h8", "h4", "h5", "h7", "h1"},
			step{op: "reserve", items: []Item{item("x", "h9", 2048)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h4", "h5"), check: func(t *testing.T, h *harness) {
				require.Equal(t, uint64(2), h.tab.Stats().Evictions)
				require.Equal(t, uint64(3072), h.grants["x"].Offset, "h4 h5 are older than h1 h2 (h1 is the newest) and h7 h8 (h7 is newer than h5)")
			}},
		)},
		{name: "fragmented slab: residents that cannot open an extent are kept", slab: 8192, steps: fragmented(
			[]string{"h1", "h4", "h7", "h2", "h5", "h8"},
			step{op: "reserve", items: []Item{item("x", "h9", 3072)}, errs: []error{ErrPoolFull},
				events: failed("refused: reserve transfer x (h9): pool full (3072 bytes asked, 8192 of 8192 bytes in use, largest free extent 0 bytes; evicting the 6144 resident bytes would not free a large enough extent)", "x"),
				check: func(t *testing.T, h *harness) {
					require.Zero(t, h.tab.Stats().Evictions, "no copy is dropped for nothing")
					require.Equal(t, 6, h.tab.Stats().Residents)
				}},
		)},
		{name: "eviction of least recently used residents; pinned never evicted", slab: 4096, steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1024), item("b", "h2", 1024), item("c", "h3", 1024)}},
			{op: "complete", tid: "a", events: ready("a")},
			{op: "complete", tid: "b", events: ready("b")},
			{op: "complete", tid: "c", events: ready("c")},
			{op: "acquire", hash: "h1"}, {op: "release", hash: "h1"},
			{op: "acquire", hash: "h2"}, {op: "release", hash: "h2"},
			{op: "acquire", hash: "h3"}, {op: "release", hash: "h3"},
			{op: "reserve", items: []Item{item("c2", "h2", 1024)}, kinds: []Kind{KindCached}, events: ready("c2")},
			{op: "acquire", hash: "h3"},
			// Order now, oldest first: h1, h2 (touched by the cached answer); h3 pinned.
			{op: "reserve", items: []Item{item("d", "h4", 2048)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h1", "h2"), check: func(t *testing.T, h *harness) {
				require.Equal(t, uint64(2), h.tab.Stats().Evictions)
				_, _, ok := h.tab.Lookup("h1")
				require.False(t, ok)
				_, _, ok = h.tab.Lookup("h2")
				require.False(t, ok)
				_, _, ok = h.tab.Lookup("h3")
				require.True(t, ok)
				require.Equal(t, StatusInfo{MMHash: "h1", State: Expired, Kind: KindWrite, NBytes: 1024, Done: true, Reason: ReasonEvicted}, h.status(t, "a"))
			}},
			{op: "reserve", items: []Item{item("e", "h5", 2048)}, errs: []error{ErrPoolFull},
				events: failed("refused: reserve transfer e (h5): pool full (2048 bytes asked, 3072 of 4096 bytes in use, largest free extent 1024 bytes)", "e")},
			{op: "release", hash: "h3"},
			{op: "reserve", items: []Item{item("e2", "h5", 2048)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h3"), check: func(t *testing.T, h *harness) {
				require.Equal(t, uint64(3), h.tab.Stats().Evictions)
			}},
		}},
		{name: "an evicted copy that served cached answers ends with one gone event, before a new copy", slab: 4096, steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 2048)}},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "reserve", items: []Item{item("c", "h1", 2048)}, kinds: []Kind{KindCached}, events: ready("c")},
			{op: "acquire", hash: "h1"}, {op: "release", hash: "h1"},
			{op: "reserve", items: []Item{item("x", "h2", 4096)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h1"), check: all(
				statusIs("w", StatusInfo{MMHash: "h1", State: Expired, Kind: KindWrite, NBytes: 2048, Done: true, Reason: ReasonEvicted}),
				// Forgotten as ready, but its bytes went with the copy.
				statusIs("c", StatusInfo{MMHash: "h1", State: Expired, Kind: KindCached, NBytes: 2048, Done: true, Reason: ReasonCopyGone}),
			)},
			{op: "complete", tid: "x", events: ready("x")},
			{op: "acquire", hash: "h2"}, {op: "release", hash: "h2"},
			{op: "reserve", items: []Item{item("w2", "h1", 2048)}, kinds: []Kind{KindWrite}, events: gone(ReasonEvicted, "h2"),
				check: statusIs("c", StatusInfo{MMHash: "h1", State: Expired, Kind: KindCached, NBytes: 2048, Done: true, Reason: ReasonCopyGone})},
			{op: "complete", tid: "w2", events: ready("w2"), check: statusIs("c",
				StatusInfo{MMHash: "h1", State: Ready, Kind: KindCached, NBytes: 2048, Done: true})},
		}},
		{name: "eviction is skipped when it cannot help", slab: 4096, steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1024), item("b", "h2", 2048)}},
			{op: "complete", tid: "a", events: ready("a")},
			{op: "acquire", hash: "h1"}, {op: "release", hash: "h1"},
			{op: "reserve", items: []Item{item("c", "h3", 3000)}, errs: []error{ErrPoolFull},
				events: failed("refused: reserve transfer c (h3): pool full (3000 bytes asked, 3072 of 4096 bytes in use, largest free extent 1024 bytes; evicting the 1024 resident bytes would not free a large enough extent)", "c"),
				check: func(t *testing.T, h *harness) {
					require.Zero(t, h.tab.Stats().Evictions)
					require.Equal(t, 1, h.tab.Stats().Residents)
				}},
		}},
		{name: "resident bytes cap", cfg: Config{Lease: lease, MaxResidentBytes: 2048}, steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1000), item("b", "h2", 1000), item("c", "h3", 1000)}},
			{op: "complete", tid: "a", events: ready("a")},
			{op: "complete", tid: "b", events: ready("b")},
			{op: "complete", tid: "c", events: ready("c")},
			{op: "acquire", hash: "h1"}, {op: "acquire", hash: "h2"}, {op: "acquire", hash: "h3"},
			{op: "release", hash: "h1"}, {op: "release", hash: "h2"},
			{op: "release", hash: "h3", events: gone(ReasonEvicted, "h1"), check: func(t *testing.T, h *harness) {
				s := h.tab.Stats()
				require.Equal(t, 2, s.Residents)
				require.Equal(t, uint64(2048), s.ResidentBytes)
				_, _, ok := h.tab.Lookup("h1")
				require.False(t, ok, "the oldest resident goes first")
			}},
		}},
		{name: "cached answers", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "reserve", items: []Item{item("c1", "h1", 1000)}, kinds: []Kind{KindCached}, events: ready("c1")},
			{op: "acquire", hash: "h1"},
			{op: "reserve", items: []Item{item("c2", "h1", 1000)}, kinds: []Kind{KindCached}, events: ready("c2")},
			{op: "release", hash: "h1"},
			{op: "reserve", items: []Item{item("c3", "h1", 1000), item("c3", "h1", 1000)}, kinds: []Kind{KindCached, KindCached}, events: ready("c3")},
			{op: "reserve", items: []Item{item("c1", "h1", 1000)}, kinds: []Kind{KindCached}},
			{op: "reserve", items: []Item{item("c4", "h1", 999)}, errs: []error{ErrSizeMismatch}, check: func(t *testing.T, h *harness) {
				s := h.tab.Stats()
				require.Equal(t, 1, s.Transfers, "cached transfers leave no live record")
				require.Equal(t, 3, s.Tombstones)
				require.Equal(t, uint64(1024), s.BytesInUse)
			}},
		}},
		{name: "repeated reserves are idempotent", steps: []step{
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f", "h1", 1000)}, kinds: []Kind{KindWrite, KindFollow}},
			{op: "reserve", items: []Item{item("f", "h1", 1000), item("w", "h1", 1000)}, kinds: []Kind{KindFollow, KindWrite}, check: inUse(1024)},
			{op: "complete", tid: "w", events: ready("w", "f")},
			{op: "reserve", items: []Item{item("w", "h1", 1000), item("f", "h1", 1000)}, kinds: []Kind{KindWrite, KindFollow}},
			{op: "reserve", items: []Item{item("w", "h1", 2000)}, errs: []error{ErrSizeMismatch}},
		}},
		{name: "transfer id collision fails only that item", steps: []step{
			{op: "reserve", items: []Item{item("t1", "h1", 1000), item("t1", "h2", 1000), item("t2", "h2", 1000)},
				kinds: []Kind{KindWrite, 0, KindWrite}, errs: []error{nil, ErrCollision, nil}},
			{op: "cancel", tid: "t1", events: failed(ReasonCancelled, "t1")},
			{op: "reserve", items: []Item{item("t1", "h3", 1000), item("t3", "h3", 1000)},
				kinds: []Kind{0, KindWrite}, errs: []error{ErrCollision, nil}, check: inUse(2048)},
		}},
		{name: "invalid items", steps: []step{
			{op: "reserve", items: []Item{item("", "h1", 1), item("t", "", 1), item("t", "h1", 0), item("t", "h1", 1)},
				kinds: []Kind{0, 0, 0, KindWrite}, errs: []error{ErrInvalid, ErrInvalid, ErrInvalid, nil}},
		}},
		{name: "a new reservation does not join a doomed region", steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1000)}},
			{op: "begin", tid: "a", off: 0, n: 1000},
			{op: "abandon", tid: "a", events: failed(ReasonAbandoned, "a")},
			{op: "reserve", items: []Item{item("b", "h1", 1000)}, kinds: []Kind{KindWrite}, check: inUse(2048)},
			{op: "end", tid: "a", ok: true, check: inUse(1024)},
			{op: "complete", tid: "b", events: ready("b")},
		}},
		{name: "acquire and release errors", steps: []step{
			{op: "acquire", hash: "h1", err: ErrUnknown},
			{op: "reserve", items: []Item{item("w", "h1", 1000)}},
			{op: "acquire", hash: "h1", err: ErrNotReady},
			{op: "release", hash: "h1", err: ErrNotPinned},
			{op: "complete", tid: "w", events: ready("w")},
			{op: "release", hash: "h1", err: ErrNotPinned},
			{op: "acquire", hash: "h1"},
			{op: "acquire", hash: "h1"},
			{op: "release", hash: "h1", check: func(t *testing.T, h *harness) { require.Equal(t, 1, h.tab.Stats().Pinned) }},
			{op: "release", hash: "h1", check: func(t *testing.T, h *harness) { require.Equal(t, 1, h.tab.Stats().Residents) }},
			{op: "release", hash: "h1", err: ErrNotPinned},
		}},
		{name: "everything released returns every byte", steps: []step{
			{op: "reserve", items: []Item{item("a", "h1", 1000), item("b", "h2", 5000), item("f", "h1", 1000), item("c", "h3", 300)}},
			{op: "begin", tid: "a", off: 0, n: 1000},
			{op: "begin", tid: "b", off: 0, n: 5000},
			{op: "end", tid: "a", ok: true},
			{op: "complete", tid: "a", events: ready("a", "f")},
			{op: "acquire", hash: "h1"},
			{op: "cancel", tid: "b", events: failed(ReasonCancelled, "b")},
			{op: "abandon", tid: "c", events: failed(ReasonAbandoned, "c")},
			{op: "release", hash: "h1"},
			{op: "end", tid: "b", ok: false},
			{op: "evict", events: gone(ReasonEvicted, "h1"), check: all(inUse(0), func(t *testing.T, h *harness) {
				require.Zero(t, h.slab.Allocations())
				s := h.tab.Stats()
				require.Zero(t, s.Transfers)
				require.Equal(t, map[State]int{Writing: 0, Ready: 0, CancelPending: 0, ExpirePending: 0}, s.Regions)
			})},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			size := tc.slab
			if size == 0 {
				size = 16 << 10
			}
			cfg := tc.cfg
			if cfg.Lease == 0 {
				cfg.Lease = lease
			}
			newHarness(size, cfg).run(t, tc.steps)
		})
	}
}

func TestTombstoneBound(t *testing.T) {
	h := newHarness(16<<10, Config{Lease: lease, MaxTombstones: 4})
	var steps []step
	tids := []string{"t0", "t1", "t2", "t3", "t4", "t5"}
	for _, id := range tids {
		steps = append(steps,
			step{op: "reserve", items: []Item{item(id, "h-"+id, 1000)}},
			step{op: "cancel", tid: id, events: failed(ReasonCancelled, id)},
		)
	}
	h.run(t, steps)
	// Each cancelled write leaves two tombstones: its transfer and its region.
	require.Equal(t, 4, h.tab.Stats().Tombstones)
	_, ok := h.tab.Status("t3")
	require.False(t, ok, "the oldest tombstones are forgotten")
	require.ErrorIs(t, h.tab.Cancel("t3", h.now), ErrUnknown)
	require.NoError(t, h.tab.Cancel("t5", h.now), "a recent tombstone still absorbs a late cancel")
	g := h.grants["t0"]
	_, err := h.tab.BeginWrite(g.Res, g.Token, 0, 1, h.now)
	require.ErrorIs(t, err, ErrGone, "a forgotten region id is still known to be over")
}

func TestResidentHashReservedManyTimes(t *testing.T) {
	h := newHarness(16<<10, Config{Lease: lease, MaxTombstones: 100})
	h.run(t, []step{
		{op: "reserve", items: []Item{item("w", "h1", 1000)}},
		{op: "complete", tid: "w", events: ready("w")},
		{op: "acquire", hash: "h1"},
		{op: "release", hash: "h1"},
	})
	for i := range 10000 {
		g := h.tab.Reserve([]Item{item("c"+strconv.Itoa(i), "h1", 1000)}, h.now)
		require.Equal(t, KindCached, g[0].Kind)
	}
	require.Len(t, h.tab.Ready().Events, 10000)
	s := h.tab.Stats()
	require.Equal(t, 1, s.Transfers)
	require.Equal(t, 100, s.Tombstones)
	require.Equal(t, uint64(1), s.Completed, "a cached answer is no completed write")
	require.Equal(t, uint64(1000), s.CompletedBytes)
	require.LessOrEqual(t, cap(h.tab.tomb.queue), 400, "the tombstone queue's backing array stays bounded")
	require.NoError(t, h.tab.CheckInvariants())
}

func TestConfigDefaults(t *testing.T) {
	c := Config{}.withDefaults(1 << 20)
	require.Equal(t, DefaultLease, c.Lease)
	require.Equal(t, DefaultMaxTombstones, c.MaxTombstones)
	require.Zero(t, c.MaxResidentBytes)
	require.Equal(t, DefaultMaxFollowers, c.MaxFollowers)
	require.Equal(t, DefaultMaxPendingPerOwner, c.MaxPendingPerOwner)
	require.Equal(t, DefaultMaxFollowersPerOwner, c.MaxFollowersPerOwner)
	require.Equal(t, uint64(3<<18), c.MaxPendingBytesPerOwner, "three quarters of the slab")
	require.Equal(t, DefaultMaxOwnersPerPeer, c.MaxOwnersPerPeer)
	require.Equal(t, DefaultCreditLease, c.CreditLease)
	require.Zero(t, c.CreditWindowBytes, "credit is off by default")
	set := Config{Lease: time.Second, MaxTombstones: 3, MaxResidentBytes: 7, MaxFollowers: 2, MaxPendingPerOwner: 5, MaxPendingBytesPerOwner: 9, MaxFollowersPerOwner: 4, MaxOwnersPerPeer: 2,
		CreditWindowBytes: 4096, CreditLease: time.Minute}
	require.Equal(t, set, set.withDefaults(1<<20))
}
