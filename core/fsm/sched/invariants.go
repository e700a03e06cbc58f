package sched

import (
	"github.com/ecmooncake/ecmooncake/core/internal/invariant"
)

// CheckInvariants walks the whole table and reports every inconsistency it
// finds, each wrapping ErrInvariant. It costs O(size of the table): tests
// call it after every step, production code when it suspects a bug.
func (t *Table) CheckInvariants() error {
	rep := invariant.New(ErrInvariant).IllegalMoves(t.illegalMoves)
	bad := rep.Bad

	current := make(map[string]uint64, len(t.deadlines))
	for _, d := range t.deadlines {
		if r := t.records[d.id]; r != nil && r.seq == d.seq {
			if !d.at.Equal(r.deadline) {
				bad("transfer %s: deadline entry %v, record says %v", d.id, d.at, r.deadline)
			}
			current[d.id] = d.seq
		}
	}

	indexed := 0
	for hash, of := range t.earlyOf {
		if len(of) == 0 {
			bad("early index keeps an empty set for %s", hash)
		}
		for id, e := range of {
			if t.early[id] != e || e.hash != hash {
				bad("early index names transfer %s under %s, which is not its early entry", id, hash)
			}
			indexed++
		}
	}
	if indexed != len(t.early) {
		bad("early index holds %d entries, early %d", indexed, len(t.early))
	}

	for id, r := range t.records {
		if id != r.id {
			bad("record keyed %s names %s", id, r.id)
		}
		if r.state >= numStates || r.state.Terminal() {
			bad("transfer %s: live record in %s", id, r.state)
		}
		if _, ok := t.tombs[id]; ok {
			bad("transfer %s: both live and a tombstone", id)
		}
		if _, ok := t.early[id]; ok {
			bad("transfer %s: live record with early events left over", id)
		}
		if !r.shards.inRange(t.cfg.Shards) {
			bad("transfer %s: shard bitmap %x outside %d shards", id, []uint64(r.shards), t.cfg.Shards)
		}
		full := r.shards.count() == t.cfg.Shards
		if r.state == WaitingEvent && full {
			bad("transfer %s: every shard ready but still %s", id, r.state)
		}
		if r.state.usable() && !full {
			bad("transfer %s: %s with %d of %d shards ready", id, r.state, r.shards.count(), t.cfg.Shards)
		}
		wantDeadline := r.state == WaitingEvent || r.state == Available || r.state == Loading ||
			(r.state == Resident && t.cfg.ResidentTTL > 0)
		hasDeadline := r.seq != 0
		if wantDeadline != hasDeadline {
			bad("transfer %s: %s with deadline=%v", id, r.state, hasDeadline)
		}
		if hasDeadline && current[id] != r.seq {
			bad("transfer %s: deadline entry %d missing from the heap", id, r.seq)
		}
		n := 0
		for _, x := range t.byHash[r.hash] {
			if x == r {
				n++
			}
		}
		if n != 1 {
			bad("transfer %s: listed %d times under mm_hash %s", id, n, r.hash)
		}
		seen := make(map[string]bool, len(r.requests))
		for _, rid := range r.requests {
			if seen[rid] {
				bad("transfer %s: request %s attached twice", id, rid)
			}
			seen[rid] = true
			req := t.requests[rid]
			if req == nil {
				bad("transfer %s: attached request %s unknown", id, rid)
				continue
			}
			if _, ok := req.index[id]; !ok {
				bad("transfer %s: attached request %s does not expect it", id, rid)
			}
		}
		if r.state == Ready && len(r.requests) > 0 {
			bad("transfer %s: %s with requests still attached", id, r.state)
		}
		if t.idle(r) {
			bad("transfer %s: %s outlived every request for %s", id, r.state, r.hash)
		}
	}

	for h, list := range t.byHash {
		if len(list) == 0 {
			bad("mm_hash %s: empty index entry", h)
		}
		for _, r := range list {
			if t.records[r.id] != r || r.hash != h {
				bad("mm_hash %s: index names dead or foreign transfer %s", h, r.id)
			}
		}
	}

	for rid, req := range t.requests {
		if rid != req.id {
			bad("request keyed %s names %s", rid, req.id)
		}
		if len(req.index) != len(req.items) {
			bad("request %s: %d items, %d indexed", rid, len(req.items), len(req.index))
		}
		for _, it := range req.items {
			attached := false
			if r := t.records[it.TransferID]; r != nil {
				for _, x := range r.requests {
					attached = attached || x == rid
				}
				if attached && r.hash != it.MMHash {
					bad("request %s: transfer %s holds %s, request expects %s", rid, it.TransferID, r.hash, it.MMHash)
				}
			}
			_, failed := req.failed[it.TransferID]
			_, served := req.served[it.TransferID]
			if n := btoi(attached) + btoi(failed) + btoi(served); n != 1 {
				bad("request %s: transfer %s attached=%v failed=%v served=%v", rid, it.TransferID, attached, failed, served)
			}
		}
		for tid := range req.failed {
			if _, ok := req.index[tid]; !ok {
				bad("request %s: failure for transfer %s it does not expect", rid, tid)
			}
		}
		for tid := range req.served {
			if _, ok := req.index[tid]; !ok {
				bad("request %s: served transfer %s it does not expect", rid, tid)
			}
		}
	}

	if len(t.tombs) != len(t.tombQ) || len(t.tombs) > t.cfg.MaxTombstones {
		bad("%d tombstones, %d queued, limit %d", len(t.tombs), len(t.tombQ), t.cfg.MaxTombstones)
	}
	for _, id := range t.tombQ {
		ts, ok := t.tombs[id]
		if !ok || !ts.state.Terminal() {
			bad("tombstone %s: missing or not terminal", id)
		}
	}

	if len(t.early) > t.cfg.MaxEarlyEvents {
		bad("%d early entries, limit %d", len(t.early), t.cfg.MaxEarlyEvents)
	}
	queuedEarly := make(map[string]bool, len(t.early))
	for _, q := range t.earlyQ {
		if e := t.early[q.id]; e != nil && e.seq == q.seq {
			queuedEarly[q.id] = true
		}
	}
	for id, e := range t.early {
		if _, ok := t.tombs[id]; ok {
			bad("early entry %s: transfer already ended", id)
		}
		if !queuedEarly[id] {
			bad("early entry %s: not queued", id)
		}
		if !e.shards.inRange(t.cfg.Shards) {
			bad("early entry %s: shard bitmap %x outside %d shards", id, []uint64(e.shards), t.cfg.Shards)
		}
	}
	t.checkChanges(bad)
	return rep.Err()
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// checkChanges checks the change log and the askers index: the log holds
// each generation since changesFrom once, in order, up to the current one;
// askers names exactly the live requests with an item of each content.
func (t *Table) checkChanges(bad func(string, ...any)) {
	want := t.changesFrom
	for _, c := range t.changes {
		if c.gen != want+1 {
			bad("change log: generation %d after %d", c.gen, want)
		}
		want = c.gen
	}
	if want != t.gen {
		bad("change log ends at generation %d, the table is at %d", want, t.gen)
	}
	if len(t.changes) > maxChanges {
		bad("change log holds %d entries, limit %d", len(t.changes), maxChanges)
	}
	asked := make(map[string]map[string]struct{})
	for id, req := range t.requests {
		for _, it := range req.items {
			if asked[it.MMHash] == nil {
				asked[it.MMHash] = make(map[string]struct{})
			}
			asked[it.MMHash][id] = struct{}{}
		}
	}
	if len(asked) != len(t.askers) {
		bad("askers index %d contents, live requests ask for %d", len(t.askers), len(asked))
	}
	for h, ids := range asked {
		got := t.askers[h]
		if len(got) != len(ids) {
			bad("askers of %s: %d indexed, %d live requests ask", h, len(got), len(ids))
			continue
		}
		for id := range ids {
			if _, ok := got[id]; !ok {
				bad("askers of %s: request %s not indexed", h, id)
			}
		}
	}
}
