package push

import (
	"encoding/binary"
	"hash/maphash"
	"slices"
)

// A producer ends pushes by the tens of thousands and remembers up to
// MaxTombstones of them (65,536 by default), so that the same transfer_id
// announced again is known. The collector runs every few thousand
// batches and scans every pointer the heap holds: tombstones keyed by
// their transfer_id strings, each naming its destinations, made the
// largest part of that scan. So the tombstones' map and queue hold no
// pointer: a tombstone is keyed by a seeded 64-bit hash of its
// transfer_id and names its destination list by a number; the few things
// that do hold pointers (a transfer one of whose records still waits for
// its reservation's answer, the states of destinations past the first
// tombStates) sit in small side maps.
//
// The cost: two transfer_ids share a key with a chance of 2^-64 a pair.
// Then the later one to end replaces the earlier one's tombstone, the
// earlier transfer_id announced again is refused as a collision or taken
// as the other push, and Status of one may answer with the other's states.

// tombStates is how many destinations' states a tombstone keeps inline:
// a push goes to one shard per tensor-parallel rank of its consumer.
const tombStates = 4

// tomb is what the manager remembers of an ended transfer: the digest of
// its push (the same transfer_id announced again must be the same push),
// its destination list and its records' last states (Status).
type tomb struct {
	digest uint64
	dests  uint32            // its destination list, in tombstones.dests
	states [tombStates]State // its records' last states, in Dests order
}

// tombstones are the ended transfers the manager remembers, oldest first.
type tombstones struct {
	byKey map[uint64]tomb // by tombKey of the transfer_id
	queue []uint64        // keys, oldest first
	// full keeps a transfer one of whose records waits for its
	// reservation's answer, so that the answer finds that record.
	full map[uint64]*transfer
	// more keeps the states of destinations past the first tombStates.
	more  map[uint64][]State
	dests destLists
}

func newTombstones() tombstones {
	return tombstones{
		byKey: make(map[uint64]tomb),
		full:  make(map[uint64]*transfer),
		more:  make(map[uint64][]State),
		dests: destLists{ids: make(map[string]uint32)},
	}
}

// tombKey is a transfer_id's key among the tombstones.
func (m *Manager) tombKey(transferID string) uint64 { return maphash.String(m.seed, transferID) }

// retire remembers an ended transfer, and forgets the oldest tombstones
// past MaxTombstones.
func (m *Manager) retire(tr *transfer) {
	ts := &m.tombs
	k := m.tombKey(tr.push.TransferID)
	if _, ok := ts.byKey[k]; ok {
		// Another transfer_id with the same key (see above).
		m.forgetTomb(k)
		ts.queue = slices.DeleteFunc(ts.queue, func(x uint64) bool { return x == k })
	}
	t := tomb{digest: m.digest(tr.push), dests: ts.dests.ref(tr.push.Dests)}
	var more []State
	for i, r := range tr.recs {
		if i < tombStates {
			t.states[i] = r.state
		} else {
			more = append(more, r.state)
		}
		if r.unanswered {
			ts.full[k] = tr
		}
	}
	if more != nil {
		ts.more[k] = more
	}
	ts.byKey[k] = t
	ts.queue = append(ts.queue, k)
	for len(ts.queue) > m.cfg.MaxTombstones {
		m.forgetTomb(ts.queue[0])
		ts.queue = ts.queue[1:]
	}
}

// forgetTomb drops the tombstone of k; a record still waiting for its
// answer is answered now, as no grant will find it again.
func (m *Manager) forgetTomb(k uint64) {
	ts := &m.tombs
	if full := ts.full[k]; full != nil {
		for _, r := range full.recs {
			if r.unanswered {
				m.answer(r)
			}
		}
		delete(ts.full, k)
	}
	delete(ts.more, k)
	ts.dests.unref(ts.byKey[k].dests)
	delete(ts.byKey, k)
}

// status is Status of the tombstone of transferID, whose key is k.
func (ts *tombstones) status(k uint64, transferID string) (map[string]State, bool) {
	t, ok := ts.byKey[k]
	if !ok {
		return nil, false
	}
	if full := ts.full[k]; full != nil && full.push.TransferID == transferID {
		out := make(map[string]State, len(full.recs))
		for _, r := range full.recs {
			out[r.dest] = r.state
		}
		return out, true
	}
	dests := ts.dests.lists[t.dests]
	out := make(map[string]State, len(dests))
	for i, d := range dests {
		if i < tombStates {
			out[d] = t.states[i]
		} else {
			out[d] = ts.more[k][i-tombStates]
		}
	}
	return out, true
}

// destLists numbers the destination lists of the tombstones: a
// producer's pushes name a handful (one per consumer), tens of thousands
// of times. A list is forgotten when its last tombstone is.
type destLists struct {
	ids   map[string]uint32 // by key
	lists [][]string
	refs  []int
	free  []uint32 // numbers of forgotten lists
	key   []byte   // scratch for key
}

// keyOf encodes dests with each length first, so that no two lists
// share a key whatever bytes their destinations hold.
func (d *destLists) keyOf(dests []string) []byte {
	d.key = d.key[:0]
	for _, s := range dests {
		d.key = binary.AppendUvarint(d.key, uint64(len(s)))
		d.key = append(d.key, s...)
	}
	return d.key
}

// ref returns the number of dests, counting one more tombstone of it.
func (d *destLists) ref(dests []string) uint32 {
	key := d.keyOf(dests)
	if id, ok := d.ids[string(key)]; ok {
		d.refs[id]++
		return id
	}
	var id uint32
	if n := len(d.free); n > 0 {
		id, d.free = d.free[n-1], d.free[:n-1]
		d.lists[id], d.refs[id] = slices.Clone(dests), 1
	} else {
		id = uint32(len(d.lists))
		d.lists, d.refs = append(d.lists, slices.Clone(dests)), append(d.refs, 1)
	}
	d.ids[string(key)] = id
	return id
}

// unref counts one tombstone of list id fewer.
func (d *destLists) unref(id uint32) {
	if d.refs[id]--; d.refs[id] > 0 {
		return
	}
	delete(d.ids, string(d.keyOf(d.lists[id])))
	d.lists[id] = nil
	d.free = append(d.free, id)
}
