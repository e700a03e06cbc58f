package conncap

import (
	"container/list"
	"time"
)

// Why a connection was closed to keep the limits (the reason its owner
// counts it under).
const (
	// Total: the server was at Max.
	Total = "conn_cap"
	// Peer: the address was at its share, PerPeer.
	Peer = "conn_cap_peer"
)

// Table is the live set of one server's connections, keyed by whatever
// names a connection to its owner (a descriptor, a net.Conn).
//
// Each address keeps its candidates (neither proven nor busy) in a list,
// longest waiting first, so that a newcomer whose address holds others
// finds its victim at once: an accept loop under a flood must not scan
// every connection for each newcomer. The times passed in must not go
// backwards.
type Table[K comparable] struct {
	max, perPeer int
	young        time.Duration

	seq   uint64
	live  map[K]*entry[K]
	peers map[string]*peerSet[K]
}

type entry[K comparable] struct {
	key    K
	since  time.Time // accepted, or last finished a request
	seq    uint64    // orders entries of the same time
	peer   string
	proven bool
	busy   bool
	elem   *list.Element // in its peer's candidates, or nil
}

type peerSet[K comparable] struct {
	n          int        // live connections
	candidates *list.List // of *entry[K], longest waiting first
}

// New returns an empty table that admits max connections, perPeer of one
// address. With young > 0, a connection that has lived that long counts
// as proven (the control plane, whose transport drops a connection that
// fails its handshake within a deadline); with 0, only Prove proves one.
func New[K comparable](max, perPeer int, young time.Duration) *Table[K] {
	return &Table[K]{max: max, perPeer: perPeer, young: young, live: map[K]*entry[K]{}, peers: map[string]*peerSet[K]{}}
}

// Accepted records k, a connection from peer accepted at now, and says
// which connection to close to stay within the limits, and why; why is
// "" when none must go. The victim may be k itself: the newcomer is
// refused. The victim is out of the table already.
func (t *Table[K]) Accepted(k K, peer string, now time.Time) (victim K, why string) {
	t.Gone(k) // a key reused before its end was reported
	t.seq++
	e := &entry[K]{key: k, since: now, seq: t.seq, peer: peer}
	t.live[k] = e
	ps := t.peers[peer]
	if ps == nil {
		ps = &peerSet[K]{candidates: list.New()}
		t.peers[peer] = ps
	}
	ps.n++
	e.elem = ps.candidates.PushBack(e)

	from := peer
	switch {
	case len(t.live) > t.max && ps.n > t.perPeer:
		why = Total
	case len(t.live) > t.max && t.candidates(peer, now) > 1:
		// The newcomer's address makes room from its own first: a
		// flood that keeps reopening displaces itself.
		why = Total
	case len(t.live) > t.max:
		why, from = Total, t.mostUnproven(now)
	case ps.n > t.perPeer:
		why = Peer
	default:
		return victim, ""
	}
	victim = k
	if t.candidates(from, now) > 0 {
		victim = t.peers[from].candidates.Front().Value.(*entry[K]).key
	}
	t.Gone(victim)
	return victim, why
}

// candidates drops from peer's list the connections that have lived past
// young (proven by age; they lead the list) and says how many are left.
func (t *Table[K]) candidates(peer string, now time.Time) int {
	ps := t.peers[peer]
	if ps == nil {
		return 0
	}
	for t.young > 0 && ps.candidates.Len() > 0 {
		front := ps.candidates.Front()
		e := front.Value.(*entry[K])
		if now.Sub(e.since) < t.young {
			break
		}
		ps.candidates.Remove(front)
		e.elem = nil
	}
	return ps.candidates.Len()
}

// Prove marks k proven: it is never chosen to make room.
func (t *Table[K]) Prove(k K) {
	if e, ok := t.live[k]; ok {
		e.proven = true
		t.unlist(e)
	}
}

// Busy marks k as in the middle of a request (never chosen), or, with
// busy false, done with one at now: its wait starts again.
func (t *Table[K]) Busy(k K, busy bool, now time.Time) {
	e, ok := t.live[k]
	if !ok {
		return
	}
	e.busy = busy
	t.unlist(e)
	if !busy {
		t.seq++
		e.since, e.seq = now, t.seq
		if !e.proven {
			e.elem = t.peers[e.peer].candidates.PushBack(e)
		}
	}
}

func (t *Table[K]) unlist(e *entry[K]) {
	if e.elem != nil {
		t.peers[e.peer].candidates.Remove(e.elem)
		e.elem = nil
	}
}

// Gone forgets k; a key it does not hold is ignored.
func (t *Table[K]) Gone(k K) {
	e, ok := t.live[k]
	if !ok {
		return
	}
	t.unlist(e)
	delete(t.live, k)
	ps := t.peers[e.peer]
	if ps.n--; ps.n == 0 {
		delete(t.peers, e.peer)
	}
}

// Max is the cap on connections.
func (t *Table[K]) Max() int { return t.max }

// Len is the number of live connections.
func (t *Table[K]) Len() int { return len(t.live) }

func (e *entry[K]) before(o *entry[K]) bool {
	return e.since.Before(o.since) || e.since.Equal(o.since) && e.seq < o.seq
}

// mostUnproven is the address holding the most unproven connections, the
// one a flood comes from; on a tie, the one whose oldest waited longest.
// It walks the addresses, not the connections.
func (t *Table[K]) mostUnproven(now time.Time) string {
	best, most := "", 0
	var oldest *entry[K]
	for p, ps := range t.peers {
		n := t.candidates(p, now)
		if n == 0 {
			continue
		}
		front := ps.candidates.Front().Value.(*entry[K])
		if n > most || n == most && front.before(oldest) {
			best, most, oldest = p, n, front
		}
	}
	return best
}
