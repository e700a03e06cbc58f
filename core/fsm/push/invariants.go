package push

import (
	"fmt"
	"slices"

	"github.com/ecmooncake/ecmooncake/core/internal/invariant"
)

// CheckInvariants walks the whole manager and reports every inconsistency
// it finds, each wrapping ErrInvariant. It costs O(size of the manager):
// tests call it after every step, production code when it suspects a bug.
func (m *Manager) CheckInvariants() error {
	rep := invariant.New(ErrInvariant).IllegalMoves(m.illegalMoves)
	bad := rep.Bad

	inWriteQ := make(map[*rec]bool, len(m.writeQ))
	for _, r := range m.writeQ {
		if inWriteQ[r] || !r.queued {
			bad("%s: write queue entry not flagged or repeated", r)
		}
		inWriteQ[r] = true
	}
	inCompleteQ := make(map[*rec]bool, len(m.completeQ))
	for _, r := range m.completeQ {
		if inCompleteQ[r] {
			bad("%s: complete queued twice", r)
		}
		inCompleteQ[r] = true
	}
	completesOut := make(map[string]int, len(m.completesOut))
	current := make(map[*rec]bool, len(m.deadlines))
	for _, d := range m.deadlines {
		if d.current() {
			current[d.rec] = true
			if !d.at.Equal(d.rec.deadline) {
				bad("%s: deadline entry %v, record says %v", d.rec, d.at, d.rec.deadline)
			}
		}
	}

	type counts struct{ waiters, readers int }
	perHash := make(map[string]*counts)
	liveRecs, held := 0, 0
	for id, tr := range m.transfers {
		p := tr.push
		if id != p.TransferID {
			bad("transfer keyed %s names %s", id, p.TransferID)
		}
		if _, ok := m.tombs.byKey[m.tombKey(id)]; ok {
			bad("transfer %s: both live and a tombstone", id)
		}
		if len(tr.recs) != len(p.Dests) {
			bad("transfer %s: %d records for %d destinations", id, len(tr.recs), len(p.Dests))
		}
		live, inFlight := 0, 0
		n := perHash[p.MMHash]
		if n == nil {
			n = &counts{}
			perHash[p.MMHash] = n
		}
		for i, r := range tr.recs {
			if r.tr != tr || i >= len(p.Dests) || r.dest != p.Dests[i] {
				bad("%s: does not belong to its transfer", r)
			}
			if !r.state.Terminal() {
				live++
			}
			if r.inFlight {
				inFlight++
				n.readers++
			}
			if r.state.needsSource() {
				n.waiters++
			}
			if r.queued != inWriteQ[r] {
				bad("%s: queued=%v, in write queue=%v", r, r.queued, inWriteQ[r])
			}
			if r.completeOut {
				completesOut[r.dest]++
			}
			if r.state == Notifying && r.completeOut == inCompleteQ[r] {
				bad("%s: complete out=%v and queued=%v: want exactly one", r, r.completeOut, inCompleteQ[r])
			}
			m.checkRecord(r, current[r], bad)
		}
		liveRecs += live
		if live != tr.live || inFlight != tr.inFlight {
			bad("transfer %s: counts live=%d in flight=%d, records say %d and %d", id, tr.live, tr.inFlight, live, inFlight)
		}
		if live == 0 && inFlight == 0 {
			bad("transfer %s: finished but not retired", id)
		}
		c := m.contents[p.MMHash]
		if c == nil {
			bad("transfer %s: no content entry for %s", id, p.MMHash)
			continue
		}
		listed := 0
		for _, x := range c.transfers {
			if x == tr {
				listed++
			}
		}
		if listed != 1 || c.nbytes != p.NBytes {
			bad("transfer %s: listed %d times under %s, content is %d bytes, push %d", id, listed, p.MMHash, c.nbytes, p.NBytes)
		}
	}
	if liveRecs != m.liveRecs {
		bad("%d live records counted, %d found", m.liveRecs, liveRecs)
	}

	for h, c := range m.contents {
		n := perHash[h]
		if n == nil {
			n = &counts{}
		}
		if c.waiters != n.waiters || c.readers != n.readers {
			bad("content %s: waiters=%d readers=%d, records say %d and %d", h, c.waiters, c.readers, n.waiters, n.readers)
		}
		for _, tr := range c.transfers {
			if m.transfers[tr.push.TransferID] != tr {
				bad("content %s: lists dead transfer %s", h, tr.push.TransferID)
			}
		}
		if len(c.transfers) == 0 && c.src == 0 {
			bad("content %s: neither pushes nor a source", h)
		}
		if c.src != 0 && c.waiters == 0 && c.readers == 0 {
			// Records whose bytes landed (Notifying, with their complete
			// queued or out) neither wait nor read: the source goes back at
			// the next Ready, before any complete is acknowledged.
			if _, queued := m.checkSet[h]; !queued {
				bad("content %s: holds source %d that no push needs, not queued for release", h, c.src)
			}
		}
		if c.src != 0 {
			held++
			if len(c.transfers) > 0 && c.srcBytes != c.nbytes {
				bad("content %s: source of %d bytes for pushes of %d", h, c.srcBytes, c.nbytes)
			}
		}
	}
	for h, n := range perHash {
		if m.contents[h] == nil && (n.waiters > 0 || n.readers > 0) {
			bad("content %s: records without a content entry", h)
		}
	}
	if held != m.held {
		bad("%d sources counted, %d held", m.held, held)
	}

	if len(completesOut) != len(m.completesOut) {
		bad("%d shards with completes out counted, %d found", len(m.completesOut), len(completesOut))
	}
	for d, n := range m.completesOut {
		if completesOut[d] != n || n > m.cfg.CompleteWindow {
			bad("shard %s: %d completes out counted, %d found, window %d", d, n, completesOut[d], m.cfg.CompleteWindow)
		}
	}

	perDestHash := make(map[destHash]int, len(m.abandoning))
	for k, h := range m.cancelsOut {
		perDestHash[destHash{k.dest, h}]++
	}
	if len(perDestHash) != len(m.abandoning) {
		bad("%d shard and content pairs with cancels out, %d counted", len(perDestHash), len(m.abandoning))
	}
	for k, n := range m.abandoning {
		if perDestHash[k] != n {
			bad("content %s on %s: %d cancels out counted, %d found", k.mmHash, k.dest, n, perDestHash[k])
		}
	}

	unanswered := make(map[destHash]int, len(m.unanswered))
	count := func(tr *transfer) {
		for _, r := range tr.recs {
			switch {
			case r.unanswered && (!r.state.Terminal() || !r.asked || r.answered || r.hasGrant):
				bad("transfer %s to %s: held as unanswered while %s (asked %v, answered %v, grant %v)", tr.push.TransferID, r.dest, r.state, r.asked, r.answered, r.hasGrant)
			case r.unanswered:
				unanswered[destHash{r.dest, tr.push.MMHash}]++
			}
		}
	}
	for _, tr := range m.transfers {
		count(tr)
	}
	for _, full := range m.tombs.full {
		count(full)
	}
	if len(unanswered) != len(m.unanswered) {
		bad("%d shard and content pairs with unanswered reservations, %d counted", len(unanswered), len(m.unanswered))
	}
	for k, n := range m.unanswered {
		if unanswered[k] != n {
			bad("content %s on %s: %d unanswered reservations counted, %d found", k.mmHash, k.dest, n, unanswered[k])
		}
	}

	m.checkTombs(bad)
	return rep.Err()
}

// checkRecord verifies what one record's state implies. A write in flight
// must read a source that is still held: a released source is never read.
func (m *Manager) checkRecord(r *rec, hasEntry bool, bad func(string, ...any)) {
	switch r.state {
	case Writing, CancelPending:
		if !r.inFlight {
			bad("%s: no write in flight", r)
		}
	case Failed:
	default:
		if r.inFlight {
			bad("%s: write in flight", r)
		}
	}
	if r.completeOut && r.state != Notifying {
		bad("%s: holds a place among the completes out", r)
	}
	if r.inFlight {
		if c := m.contents[r.tr.push.MMHash]; c == nil || c.src == 0 || c.src != r.src {
			bad("%s: in-flight write reads source %d, which is not held", r, r.src)
		}
	}
	switch r.state {
	case Reserving:
		if r.hasGrant {
			bad("%s: holds a grant", r)
		}
	case WaitingInputs, Writing, Notifying, CancelPending:
		if !r.hasGrant || r.grant.Kind != KindWrite || r.grant.Res == 0 {
			bad("%s: without a write grant", r)
		}
	}
	if r.state == WaitingInputs && !r.queued {
		if c := m.contents[r.tr.push.MMHash]; c != nil && c.src != 0 {
			bad("%s: source held but no write queued", r)
		}
	}
	if r.cancelWanted && !r.state.Terminal() && !r.followed && !m.awaitedAt(r) {
		bad("%s: a cancel waits though no other push follows or may follow", r)
	}
	if r.state == WaitingInputs && r.deadline.After(r.sourceDue) && !r.followed && !r.overdue {
		bad("%s: waits past its source deadline though nobody follows it", r)
	}
	if r.overdue {
		if _, wait := m.overdueAt(r); r.state != WaitingInputs || !wait {
			bad("%s: waits past its source deadline though no reservation of its content to that shard is out", r)
		}
	}
	if r.state.Terminal() {
		if r.seq != 0 {
			bad("%s: keeps a deadline", r)
		}
	} else if r.seq == 0 || !hasEntry {
		bad("%s: no current deadline", r)
	}
}

func (r *rec) String() string {
	return fmt.Sprintf("transfer %s to %s (%s)", r.tr.push.TransferID, r.dest, r.state)
}

// checkTombs checks the tombstones: each queued once and kept, within
// their bound, every state terminal, the side maps only of tombstones,
// each destination list counted by the tombstones that name it.
func (m *Manager) checkTombs(bad func(string, ...any)) {
	ts := &m.tombs
	if len(ts.byKey) != len(ts.queue) || len(ts.byKey) > m.cfg.MaxTombstones {
		bad("%d tombstones, %d queued, limit %d", len(ts.byKey), len(ts.queue), m.cfg.MaxTombstones)
	}
	refs := make(map[uint32]int)
	for _, k := range ts.queue {
		t, ok := ts.byKey[k]
		if !ok {
			bad("tombstone %#x: queued but missing", k)
			continue
		}
		if int(t.dests) >= len(ts.dests.lists) || ts.dests.lists[t.dests] == nil {
			bad("tombstone %#x: names destination list %d, which is not kept", k, t.dests)
			continue
		}
		refs[t.dests]++
		dests := ts.dests.lists[t.dests]
		if n := max(0, len(dests)-tombStates); len(ts.more[k]) != n {
			bad("tombstone %#x: %d states past the first %d for %d destinations", k, len(ts.more[k]), tombStates, len(dests))
		}
		full := ts.full[k]
		if full == nil {
			st, _ := ts.status(k, "")
			for d, s := range st {
				if !s.Terminal() {
					bad("tombstone %#x: %s remembered as %s", k, d, s)
				}
			}
			continue
		}
		if m.tombKey(full.push.TransferID) != k {
			bad("tombstone %#x: holds transfer %s", k, full.push.TransferID)
		}
		if !slices.Equal(full.push.Dests, dests) {
			bad("tombstone %#x: destinations %v, transfer's %v", k, dests, full.push.Dests)
		}
		for _, r := range full.recs {
			if !r.state.Terminal() || r.inFlight {
				bad("tombstone %#x: %s still live", k, r)
			}
		}
	}
	for k := range ts.full {
		if _, ok := ts.byKey[k]; !ok {
			bad("transfer of tombstone %#x kept without its tombstone", k)
		}
	}
	for k := range ts.more {
		if _, ok := ts.byKey[k]; !ok {
			bad("states of tombstone %#x kept without it", k)
		}
	}
	for id, list := range ts.dests.lists {
		n := refs[uint32(id)]
		switch {
		case list == nil && n > 0:
			bad("destination list %d: forgotten, named by %d tombstones", id, n)
		case list != nil && ts.dests.refs[id] != n:
			bad("destination list %d %v: counted %d, named by %d tombstones", id, list, ts.dests.refs[id], n)
		case list != nil && ts.dests.ids[string(ts.dests.keyOf(list))] != uint32(id):
			bad("destination list %d %v: not found by its destinations", id, list)
		}
	}
	if len(ts.dests.ids)+len(ts.dests.free) != len(ts.dests.lists) {
		bad("%d destination lists, %d found by destinations, %d free", len(ts.dests.lists), len(ts.dests.ids), len(ts.dests.free))
	}
}
