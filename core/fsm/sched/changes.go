package sched

import (
	"sort"
	"time"
)

// The engine loop remembers Has and Failures answers at one generation
// and asks again only once the generation moved (Generation). Asking for
// every live request's answers again (Snapshot) costs in proportion to the
// live requests, a few hundred on a busy PD, and the generation moves with
// every item that arrives. So the table logs what each generation touched
// (a content, a request), and Changes answers only for what moved since
// the generation the caller holds.

// maxChanges bounds the log: past it the older half is dropped, and a
// caller that holds a generation from before what is kept takes a
// Snapshot instead.
const maxChanges = 4096

// change is what one generation touched: the content of a record that
// moved or of an item Expect added, and the request Expect or Finish
// changed ("" for none).
type change struct {
	gen             uint64
	hash, requestID string
}

// bump moves the generation for a change to hash or requestID.
func (t *Table) bump(hash, requestID string) {
	t.gen++
	if len(t.changes) >= maxChanges {
		drop := len(t.changes) - maxChanges/2
		t.changesFrom = t.changes[drop-1].gen
		t.changes = append(t.changes[:0], t.changes[drop:]...)
	}
	t.changes = append(t.changes, change{gen: t.gen, hash: hash, requestID: requestID})
}

// Changes brings answers taken at generation since up to date: Has of
// every content whose answer may have moved, and the Failures of every
// live request whose failures may have moved (nil: none now). ok is false when since is older than
// the log or not a generation the table gave: then take a Snapshot.
// Deadlines due at now are applied first, as Snapshot does, so the
// answers stand at Generation after the call.
func (t *Table) Changes(since uint64, now time.Time) (has map[string]bool, failures map[string][]Failure, ok bool) {
	t.advance(now)
	if since < t.changesFrom || since > t.gen {
		return nil, nil, false
	}
	from := sort.Search(len(t.changes), func(i int) bool { return t.changes[i].gen > since })
	if from == len(t.changes) {
		return nil, nil, true
	}
	requests := make(map[string]struct{})
	has = make(map[string]bool)
	for _, c := range t.changes[from:] {
		if c.requestID != "" {
			requests[c.requestID] = struct{}{}
		}
		if c.hash == "" {
			continue
		}
		if _, seen := has[c.hash]; seen {
			continue
		}
		// Also content no live request asks for any more: the owner
		// answers has_cache_item from what it remembers, and a request
		// for that content may come before its registration.
		has[c.hash] = t.covered(c.hash)
		// A request's failures follow the records and coverage of its
		// items' contents: served items whose copy is gone count too.
		for id := range t.askers[c.hash] {
			requests[id] = struct{}{}
		}
	}
	failures = make(map[string][]Failure, len(requests))
	for id := range requests {
		if req := t.requests[id]; req != nil {
			failures[id] = t.failuresOf(req)
		}
	}
	return has, failures, true
}
