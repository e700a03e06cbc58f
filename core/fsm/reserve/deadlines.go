package reserve

import (
	"container/heap"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/deadlines"
)

// The lease ends live in a min-heap so that Tick and NextDeadline cost
// O(log n) rather than a scan of every region: the consumer shard asks for
// the next deadline after every table call, and a slab can hold thousands
// of resident copies that have none. An entry is stale, and skipped, once
// its region is gone or has a different deadline; the heap is rebuilt
// when stale entries outnumber live ones.

type deadlineEntry struct {
	at  time.Time
	res ids.ResID
}

// Before makes equal deadlines expire in reservation order.
func (a deadlineEntry) Before(b deadlineEntry) bool {
	if !a.at.Equal(b.at) {
		return a.at.Before(b.at)
	}
	return a.res < b.res
}

type deadlineHeap = deadlines.Heap[deadlineEntry]

// setDeadline starts (or restarts) r's lease.
func (t *Table) setDeadline(r *region, at time.Time) {
	r.deadline = at
	t.deadlines.Add(deadlineEntry{at: at, res: r.res})
	if len(t.deadlines) > 2*len(t.regions)+64 {
		t.rebuildDeadlines()
	}
}

func (t *Table) live(e deadlineEntry) (*region, bool) {
	r, ok := t.regions[e.res]
	if !ok || r.deadline.IsZero() || !r.deadline.Equal(e.at) {
		return nil, false
	}
	return r, true
}

func (t *Table) dropStaleDeadlines() {
	for len(t.deadlines) > 0 {
		if _, ok := t.live(t.deadlines[0]); ok {
			return
		}
		t.deadlines.Take()
	}
}

// dueRegion pops the next region whose lease has ended by now, if any.
func (t *Table) dueRegion(now time.Time) *region {
	for len(t.deadlines) > 0 {
		e := t.deadlines[0]
		r, ok := t.live(e)
		if !ok {
			t.deadlines.Take()
			continue
		}
		if now.Before(e.at) {
			return nil
		}
		t.deadlines.Take()
		return r
	}
	return nil
}

func (t *Table) rebuildDeadlines() {
	kept := t.deadlines[:0]
	for _, e := range t.deadlines {
		if _, ok := t.live(e); ok {
			kept = append(kept, e)
		}
	}
	t.deadlines = kept
	heap.Init(&t.deadlines)
}
