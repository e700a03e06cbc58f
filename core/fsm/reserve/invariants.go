package reserve

import (
	"maps"

	"github.com/ecmooncake/ecmooncake/core/internal/invariant"
)

// CheckInvariants verifies the table's bookkeeping against itself and the
// slab. It walks everything, so tests call it after every step; production
// code may call it from a debug endpoint.
func (t *Table) CheckInvariants() error {
	rep := invariant.New(nil)
	bad := rep.Bad
	if t.broken != nil {
		bad("internal fault: %w", t.broken)
	}

	if t.byOff.Len() != len(t.regions) {
		bad("%d regions in address order, %d live", t.byOff.Len(), len(t.regions))
	}
	var prev *region
	t.byOff.Ascend(func(r *region) bool {
		if t.regions[r.res] != r {
			bad("region %d in address order is not live", r.res)
		}
		if prev != nil && prev.off >= r.off {
			bad("regions %d and %d out of address order (%d, %d)", prev.res, r.res, prev.off, r.off)
		}
		prev = r
		return true
	})

	// In-band landed bytes are sorted disjoint runs inside the region,
	// bounded, and kept only while the region may still be written.
	for _, r := range t.regions {
		if len(r.landed) > 0 && r.state == Ready {
			bad("ready region %d keeps %d landed runs", r.res, len(r.landed))
		}
		if len(r.landed) > maxLanded {
			bad("region %d has %d landed runs, over %d", r.res, len(r.landed), maxLanded)
		}
		for i, sp := range r.landed {
			if sp.off >= sp.end || sp.end > r.nbytes || (i > 0 && r.landed[i-1].end >= sp.off) {
				bad("region %d: landed run %d [%d,%d) is empty, outside %d bytes or not after the one before", r.res, i, sp.off, sp.end, r.nbytes)
			}
		}
	}

	// Each peer's quota use is what its live records add up to, and
	// the requesters it counts are those of its records.
	type use struct {
		pending      int
		pendingBytes uint64
		followers    int
		owners       map[string]int
	}
	want := map[string]*use{}
	at := func(peer string) *use {
		if want[peer] == nil {
			want[peer] = &use{owners: map[string]int{}}
		}
		return want[peer]
	}
	for _, r := range t.regions {
		if r.state == Writing {
			u := at(r.peer)
			u.pending++
			u.pendingBytes += r.nbytes
			u.owners[r.owner]++
		}
		for _, f := range r.followers {
			u := at(f.peer)
			u.followers++
			u.owners[f.owner]++
		}
	}
	if len(want) != len(t.peers) {
		bad("%d peers hold records, %d are counted", len(want), len(t.peers))
	}
	for peer, u := range t.peers {
		w := want[peer]
		if w == nil || w.pending != u.pending || w.pendingBytes != u.pendingBytes || w.followers != u.followers || !maps.Equal(w.owners, u.owners) {
			bad("peer %q counted %+v, holds %+v", peer, *u, w)
		}
		if len(u.owners) > t.cfg.MaxOwnersPerPeer {
			bad("peer %q holds records of %d requesters, over %d", peer, len(u.owners), t.cfg.MaxOwnersPerPeer)
		}
	}

	var inUse, residentBytes uint64
	residents := 0
	for res, r := range t.regions {
		switch {
		case r.res != res:
			bad("region %d filed under %d", r.res, res)
		case res == 0 || res > t.lastRes:
			bad("region %d was never issued (last %d)", res, t.lastRes)
		case r.state.final() || r.state >= numStates:
			bad("region %d is live in state %s", res, r.state)
		}
		if n, ok := t.slab.Len(r.off); !ok || n != r.alloc || r.alloc < r.nbytes {
			bad("region %d: slab allocation at %d is (%d, %v), region holds %d of %d bytes", res, r.off, n, ok, r.nbytes, r.alloc)
		}
		inUse += r.alloc
		if _, ok := t.tomb.regions[res]; ok {
			bad("region %d is both live and a tombstone", res)
		}
		if r.inflight < 0 || r.pins < 0 {
			bad("region %d: %d writes in flight, %d pins", res, r.inflight, r.pins)
		}
		if r.state.pending() && r.inflight == 0 {
			bad("region %d is %s with no write in flight", res, r.state)
		}
		if r.state == Ready && r.inflight != 0 {
			bad("region %d is ready with %d writes in flight", res, r.inflight)
		}
		if r.pins > 0 && (r.state != Ready || !r.acquired) {
			bad("region %d pinned %d times in state %s (acquired %v)", res, r.pins, r.state, r.acquired)
		}
		if resident := r.state == Ready && r.acquired && r.pins == 0; resident != (r.lru != nil) {
			bad("region %d: resident %v but in the LRU %v", res, resident, r.lru != nil)
		}
		if r.lru != nil {
			residents++
			residentBytes += r.alloc
			if r.lru.Value != r {
				bad("region %d: LRU element names another region", res)
			}
		}
		leased := r.state == Writing || (r.state == Ready && !r.acquired)
		if leased == r.deadline.IsZero() {
			bad("region %d in state %s (acquired %v) has deadline %v", res, r.state, r.acquired, r.deadline)
		}
		joinable := r.state == Writing || r.state == Ready
		if joinable != (t.byHash[r.mmHash] == r) {
			bad("region %d in state %s: indexed by mm_hash %v", res, r.state, t.byHash[r.mmHash] == r)
		}
		if r.state == Writing && r.writer == nil && len(r.followers) == 0 {
			bad("region %d is writing for no transfer", res)
		}
		if r.state != Writing && len(r.followers) > 0 {
			bad("region %d is %s with %d live followers", res, r.state, len(r.followers))
		}
		if r.state.pending() && r.writer != nil {
			bad("region %d is %s with a live writer", res, r.state)
		}
		if w := r.writer; w != nil && (t.transfers[w.id] != w || w.kind != KindWrite || w.region != r) {
			bad("region %d: writer %s is not its live write transfer", res, w.id)
		}
		for _, f := range r.followers {
			if t.transfers[f.id] != f || f.kind != KindFollow || f.region != r || f.done {
				bad("region %d: follower %s is not a live follow transfer", res, f.id)
			}
		}
	}
	windowBytes, pieces := t.checkWindows(bad)
	if inUse+windowBytes != t.slab.InUse() || len(t.regions)+pieces != t.slab.Allocations() {
		bad("slab has %d bytes in %d allocations, live regions %d bytes in %d, credit windows %d bytes in %d",
			t.slab.InUse(), t.slab.Allocations(), inUse, len(t.regions), windowBytes, pieces)
	}
	if residents != t.residents.Len() || residentBytes != t.residentBytes {
		bad("resident LRU holds %d regions / %d bytes, regions say %d / %d", t.residents.Len(), t.residentBytes, residents, residentBytes)
	}
	if t.cfg.MaxResidentBytes > 0 && t.residentBytes > t.cfg.MaxResidentBytes {
		bad("resident bytes %d over the cap %d", t.residentBytes, t.cfg.MaxResidentBytes)
	}
	for h, r := range t.byHash {
		if t.regions[r.res] != r || r.mmHash != h {
			bad("mm_hash %s indexes a region that is not live under that hash", h)
		}
	}

	for id, tr := range t.transfers {
		r := tr.region
		switch {
		case tr.id != id:
			bad("transfer %s filed under %s", tr.id, id)
		case r == nil || t.regions[r.res] != r:
			bad("transfer %s names no live region", id)
		case tr.mmHash != r.mmHash || tr.nbytes != r.nbytes:
			bad("transfer %s (%s, %d bytes) on region %d (%s, %d bytes)", id, tr.mmHash, tr.nbytes, r.res, r.mmHash, r.nbytes)
		case tr.kind == KindWrite && r.writer != tr:
			bad("transfer %s writes region %d, which does not know it", id, r.res)
		case tr.kind == KindFollow && r.state != Writing:
			bad("follow transfer %s is live on a %s region", id, r.state)
		case tr.kind == KindCached:
			bad("cached transfer %s is live: it should have been settled at once", id)
		case tr.done != (r.state == Ready):
			bad("transfer %s done %v on a %s region", id, tr.done, r.state)
		}
		if _, ok := t.tomb.transfers[id]; ok {
			bad("transfer %s is both live and a tombstone", id)
		}
	}

	ts := &t.tomb
	if ts.len() > ts.max || ts.len() != len(ts.transfers)+len(ts.regions) {
		bad("tombstones: %d queued (max %d), %d transfers + %d regions", ts.len(), ts.max, len(ts.transfers), len(ts.regions))
	}
	return rep.Err()
}
