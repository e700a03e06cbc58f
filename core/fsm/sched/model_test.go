package sched

import (
	"fmt"
	"math/rand"
	"slices"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
	"github.com/stretchr/testify/require"
)

// TestRandomModel drives a Table with random calls from a fixed seed over a
// small universe of requests, transfers and contents, so that collisions,
// shared transfers, early and duplicate events and deadlines all happen
// often. After every step it checks the table's own invariants and what a
// caller can observe against a model of identity and terminal states.
//
// A run needs its 3000 steps to reach every state (at half, seeds 3 and 4
// never see Failed), and its checks grow with the steps: under the race
// detector it runs two of the seeds.
func TestRandomModel(t *testing.T) {
	fsmtest.SeedsUnderRace(t, 2, func(t *testing.T, rng *rand.Rand) {
		visited, stats := runModel(t, rng, 3000)
		for st := State(0); st < numStates; st++ {
			require.True(t, visited[st], "the run should visit %s", st)
		}
		require.NotZero(t, stats.Collisions, "the run should exercise collisions")
		require.NotZero(t, stats.IgnoredEvents, "the run should exercise ignored events")
		require.NotZero(t, stats.EarlyDropped, "the run should exercise early events")
	})
}

// FuzzModel runs the same model with the fuzzer's bytes choosing every
// call, so that coverage guidance can steer towards rare interleavings.
func FuzzModel(f *testing.F) {
	fsmtest.FuzzModel(f, "sched", func(t *testing.T, rng *rand.Rand, steps int) { runModel(t, rng, steps) })
}

// runModel returns the states it saw and the final stats, so that a seeded
// run can show what it covered.
func runModel(t *testing.T, rng *rand.Rand, steps int) (map[State]bool, Stats) {
	cfg := Config{
		Shards:         2,
		EventWait:      10 * time.Second,
		LoadWait:       5 * time.Second,
		AvailableTTL:   20 * time.Second,
		ResidentTTL:    time.Duration(rng.Intn(2)) * 30 * time.Second,
		MaxTombstones:  1 << 20, // large: the model remembers every identity
		MaxEarlyEvents: 4,
	}
	tb := New(cfg)
	now := base

	pick := func(prefix string, n int) string { return fmt.Sprintf("%s%d", prefix, rng.Intn(n)) }
	// Transfer ids come from a window that slides with the steps, so that
	// new transfers keep arriving while recent ones are shared or collide.
	var window int
	pickTransfer := func() string { return fmt.Sprint("t", window+rng.Intn(10)) }
	// Mostly each transfer carries its own content; sometimes a caller gets
	// it wrong, which must collide.
	hashOf := func(tid string) string {
		if rng.Intn(12) == 0 {
			return pick("h", 4)
		}
		var n int
		fmt.Sscanf(tid, "t%d", &n)
		return fmt.Sprint("h", n%4)
	}
	visited := map[State]bool{}
	var loads []string           // transfers StartLoad handed out, as a worker would hold them
	known := map[string]string{} // transfer_id → mm_hash, first registered
	ended := map[string]State{}  // terminal state once observed

	// answers is everything a caller can ask without moving the clock:
	// the generation must change whenever it does (Generation).
	// They are kept as values, not printed, as they are taken at every step.
	answers := func() modelAnswers {
		var a modelAnswers
		for h := range a.has {
			a.has[h] = tb.Has(hashNames[h])
		}
		for r := range a.failures {
			a.failures[r] = tb.Failures(requestNames[r])
		}
		return a
	}
	lastGen, lastAnswers := tb.Generation(), answers()
	var cache engineCache
	defer func() {
		// A fuzzer's run may be a handful of steps.
		if steps >= 1000 {
			require.NotZero(t, cache.changes, "the run should bring answers up to date with Changes")
		}
	}()

	// observe reads every known transfer's state once and derives from
	// those states what Has must answer for each content: one pass over
	// the model, which grows with the steps, instead of one per content.
	observe := func(where string) {
		usable := map[string]bool{}
		// The checks in these loops run for every transfer at every step:
		// each calls require only to fail, as its bookkeeping (a stack walk
		// per call) would otherwise be most of the run's time.
		for tid, kh := range known {
			st, ok := tb.Status(tid)
			if !ok {
				require.Fail(t, fmt.Sprintf("%s: %s forgotten", where, tid))
			}
			visited[st] = true
			if prev, done := ended[tid]; done {
				if prev != st {
					require.Equal(t, prev, st, "%s: %s left terminal state", where, tid)
				}
			} else if st.Terminal() {
				ended[tid] = st
			}
			if st.usable() {
				usable[kh] = true
			}
		}
		for h := 0; h < 4; h++ {
			hash := fmt.Sprint("h", h)
			require.Equal(t, usable[hash], tb.Has(hash), "%s: Has(%s)", where, hash)
		}
	}

	// take plays the owner taking a Ready: every cancel names a transfer
	// the table cancelled, every failure a known transfer, with a reason.
	take := func(where string) {
		rd := tb.Ready(now)
		for _, tid := range rd.Cancels {
			st, ok := tb.Status(tid)
			require.True(t, ok, "%s: cancel of unknown %s", where, tid)
			require.Equal(t, Cancelled, st, where)
		}
		for _, f := range rd.Failures {
			require.NotEmpty(t, f.Reason, where)
			require.Equal(t, known[f.TransferID], f.MMHash, where)
		}
	}

	for step := 0; step < steps; step++ {
		window = step / 30
		now = now.Add(time.Duration(rng.Intn(600)) * time.Millisecond)
		var where string
		switch op := rng.Intn(100); {
		case op < 20:
			rid := pick("r", 6)
			n := 1 + rng.Intn(3)
			items := make([]Expected, n)
			collide := false
			seen := map[string]string{}
			for i := range items {
				tid := pickTransfer()
				items[i] = Expected{tid, hashOf(tid)}
				if h, ok := seen[tid]; ok && h != items[i].MMHash {
					collide = true
				}
				if h, ok := known[tid]; ok && h != items[i].MMHash {
					collide = true
				}
				seen[tid] = items[i].MMHash
			}
			where = fmt.Sprintf("step %d: expect %s %v", step, rid, items)
			err := tb.Expect(rid, items, now)
			if collide {
				require.ErrorIs(t, err, ErrCollision, where)
			} else {
				require.NoError(t, err, where)
				for _, it := range items {
					if _, ok := known[it.TransferID]; !ok {
						known[it.TransferID] = it.MMHash
					}
				}
			}
		case op < 55:
			tid := pickTransfer()
			ev := Event{Shard: rng.Intn(2), TransferID: tid, MMHash: hashOf(tid), Ready: rng.Intn(40) != 0, Reason: "x"}
			if rng.Intn(20) == 0 {
				ev.Shard = []int{-1, 2}[rng.Intn(2)]
			}
			if rng.Intn(40) == 0 {
				ev = Event{Shard: ev.Shard, MMHash: ev.MMHash, Reason: "evicted", Gone: true}
			}
			where = fmt.Sprintf("step %d: event %+v", step, ev)
			tb.OnEvent(ev, now)
			if ev.Gone && ev.Shard >= 0 && ev.Shard < 2 {
				require.False(t, tb.Has(ev.MMHash), "%s: content one shard no longer holds is still offered", where)
			}
		case op < 62:
			rid := pick("r", 6)
			where = fmt.Sprintf("step %d: ensure %s", step, rid)
			ready, failed := tb.Ensure(rid, now)
			require.False(t, ready && len(failed) > 0, where)
			for _, f := range failed {
				require.Equal(t, rid, f.RequestID, where)
				require.False(t, tb.Has(f.MMHash), where)
			}
		case op < 72:
			h := pick("h", 4)
			where = fmt.Sprintf("step %d: start load %s", step, h)
			had := tb.Has(h)
			tid, err := tb.StartLoad(h, now)
			if err == nil {
				loads = append(loads, tid)
				st, _ := tb.Status(tid)
				require.Contains(t, []State{Loading, Ready}, st, where)
				require.Equal(t, h, known[tid], where)
			} else {
				require.ErrorIs(t, err, ErrNotAvailable, where)
				require.False(t, had && tb.Has(h), where)
			}
		case op < 80:
			tid := pickTransfer()
			if len(loads) > 0 && rng.Intn(5) != 0 {
				i := rng.Intn(len(loads))
				tid = loads[i]
				loads = append(loads[:i], loads[i+1:]...)
			}
			where = fmt.Sprintf("step %d: loaded %s", step, tid)
			tb.Loaded(tid, rng.Intn(6) != 0, "boom", now)
			take(where)
		case op < 86:
			h := pick("h", 4)
			where = fmt.Sprintf("step %d: freed %s", step, h)
			tb.Freed(h, now)
		case op < 93:
			rid := pick("r", 6)
			where = fmt.Sprintf("step %d: finish %s", step, rid)
			// Ensure answers by content, so content another live request
			// can be told is there must stay there when this one ends: it
			// is loaded in the same step (the soak's "load cannot start").
			tb.Snapshot(now) // deadlines due by now fire before the question
			var others []string
			for id, req := range tb.requests {
				for _, it := range req.items {
					if id != rid && tb.Has(it.MMHash) {
						others = append(others, it.MMHash)
					}
				}
			}
			tb.Finish(rid, now)
			take(where)
			for _, h := range others {
				require.True(t, tb.Has(h), "%s: took %s from a request still waiting for it", where, h)
			}
		default:
			where = fmt.Sprintf("step %d: tick", step)
			tb.Tick(now)
			take(where)
			if at, ok := tb.NextDeadline(); ok {
				require.True(t, at.After(now), "%s: next deadline %v not after a tick at %v", where, at, now)
			}
		}
		require.NoError(t, tb.CheckInvariants(), where)
		observe(where)
		checkSnapshot(t, tb, now, where)
		cache.catchUp(t, tb, now, rng.Intn(4) == 0, where)
		gen, got := tb.Generation(), answers()
		require.GreaterOrEqual(t, gen, lastGen, "%s: the generation went back", where)
		if gen == lastGen && !lastAnswers.equal(got) {
			require.Equal(t, lastAnswers, got, "%s: answers changed, the generation did not", where)
		}
		lastGen, lastAnswers = gen, got
	}
	return visited, tb.Stats()
}

// hashNames and requestNames are the contents and requests whose answers
// the model compares across steps (answers).
var (
	hashNames    = [4]string{"h0", "h1", "h2", "h3"}
	requestNames = [6]string{"r0", "r1", "r2", "r3", "r4", "r5"}
)

// modelAnswers is what Has and Failures answer for the model's contents
// and requests.
type modelAnswers struct {
	has      [4]bool
	failures [6][]Failure
}

func (a modelAnswers) equal(b modelAnswers) bool {
	if a.has != b.has {
		return false
	}
	for r := range a.failures {
		if !sameFailures(a.failures[r], b.failures[r]) {
			return false
		}
	}
	return true
}

// sameFailures is reflect.DeepEqual for failure lists (nil differs from
// empty), without reflection.
func sameFailures(a, b []Failure) bool {
	return (a == nil) == (b == nil) && slices.Equal(a, b)
}

// checkSnapshot compares Snapshot with the answers of Has and Failures.
func checkSnapshot(t *testing.T, tb *Table, now time.Time, where string) {
	covered, failed := tb.Snapshot(now)
	got := map[string]bool{}
	// As in observe, require is called only to fail: these loops run for
	// every request at every step.
	for _, h := range covered {
		if got[h] {
			require.Fail(t, fmt.Sprintf("%s: %s listed twice", where, h))
		}
		if !tb.Has(h) {
			require.Fail(t, fmt.Sprintf("%s: snapshot covers %s, Has does not", where, h))
		}
		got[h] = true
	}
	for id, req := range tb.requests {
		for _, it := range req.items {
			if has := tb.Has(it.MMHash); has != got[it.MMHash] {
				require.Equal(t, has, got[it.MMHash], "%s: snapshot of %s", where, it.MMHash)
			}
		}
		if want := tb.Failures(id); !sameFailures(want, failed[id]) {
			require.Equal(t, want, failed[id], "%s: snapshot failures of %s", where, id)
		}
	}
	for id := range failed {
		if _, ok := tb.requests[id]; !ok {
			require.Contains(t, tb.requests, id, where)
		}
	}
}

// engineCache plays the engine loop's remembered answers (the connector's
// scheduler): taken from a Snapshot, then brought up to date with Changes
// or, now and then, with a Snapshot again. After each catch-up it must
// answer Has for every content a live request asks for, and Failures for
// every live request, as the table does.
type engineCache struct {
	gen      uint64
	valid    bool
	has      map[string]bool
	failures map[string][]Failure
	changes  int
}

func (c *engineCache) catchUp(t *testing.T, tb *Table, now time.Time, snapshot bool, where string) {
	if !c.valid || snapshot {
		covered, failed := tb.Snapshot(now)
		c.has, c.failures = map[string]bool{}, map[string][]Failure{}
		for _, req := range tb.requests {
			for _, it := range req.items {
				c.has[it.MMHash] = false
			}
		}
		for _, h := range covered {
			c.has[h] = true
		}
		for id, fs := range failed {
			c.failures[id] = fs
		}
	} else {
		has, failures, ok := tb.Changes(c.gen, now)
		require.True(t, ok, "%s: changes since generation %d (table at %d, log from %d)", where, c.gen, tb.gen, tb.changesFrom)
		for h, v := range has {
			c.has[h] = v
		}
		for id, fs := range failures {
			if len(fs) > 0 {
				c.failures[id] = fs
			} else {
				delete(c.failures, id)
			}
		}
		c.changes++
	}
	c.gen, c.valid = tb.Generation(), true
	// Every answer kept stands, also of content no live request asks for
	// any more: the owner answers has_cache_item from it.
	for h, v := range c.has {
		if v != tb.Has(h) {
			require.Fail(t, fmt.Sprintf("%s: remembered Has(%s) = %v, the table says %v", where, h, v, tb.Has(h)))
		}
	}
	for id, req := range tb.requests {
		if want := tb.Failures(id); len(want) != len(c.failures[id]) || !slices.Equal(want, c.failures[id]) {
			require.Equal(t, want, c.failures[id], "%s: remembered failures of %s", where, id)
		}
		for _, it := range req.items {
			if v, ok := c.has[it.MMHash]; !ok || v != tb.Has(it.MMHash) {
				require.Fail(t, fmt.Sprintf("%s: remembered Has(%s) = %v (known: %v), the table says %v", where, it.MMHash, v, ok, tb.Has(it.MMHash)))
			}
		}
	}
}
