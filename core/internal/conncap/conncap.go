package conncap

import "time"

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
type Table[K comparable] struct {
	max, perPeer int
	young        time.Duration

	seq   uint64
	live  map[K]*entry
	peers map[string]int // live entries by address
}

type entry struct {
	since  time.Time // accepted, or last finished a request
	seq    uint64    // orders entries of the same time
	peer   string
	proven bool
	busy   bool
}

// New returns an empty table that admits max connections, perPeer of one
// address. With young > 0, a connection that has lived that long counts
// as proven (the control plane, whose transport drops a connection that
// fails its handshake within a deadline); with 0, only Prove proves one.
func New[K comparable](max, perPeer int, young time.Duration) *Table[K] {
	return &Table[K]{max: max, perPeer: perPeer, young: young, live: map[K]*entry{}, peers: map[string]int{}}
}

// Accepted records k, a connection from peer accepted at now, and says
// which connection to close to stay within the limits, and why; why is
// "" when none must go. The victim may be k itself: the newcomer is
// refused. The victim is out of the table already.
func (t *Table[K]) Accepted(k K, peer string, now time.Time) (victim K, why string) {
	t.Gone(k) // a key reused before its end was reported
	t.seq++
	t.live[k] = &entry{since: now, seq: t.seq, peer: peer}
	t.peers[peer]++

	from := peer
	switch {
	case len(t.live) > t.max && t.peers[peer] > t.perPeer:
		why = Total
	case len(t.live) > t.max && t.unprovenOf(peer, now) > 1:
		// The newcomer's address makes room from its own first: a
		// flood that keeps reopening displaces itself.
		why = Total
	case len(t.live) > t.max:
		why, from = Total, t.mostUnproven(now)
	case t.peers[peer] > t.perPeer:
		why = Peer
	default:
		return victim, ""
	}
	victim = k
	var oldest *entry
	for key, e := range t.live {
		if e.peer == from && t.unproven(e, now) && (oldest == nil || e.before(oldest)) {
			victim, oldest = key, e
		}
	}
	t.Gone(victim)
	return victim, why
}

// Prove marks k proven: it is never chosen to make room.
func (t *Table[K]) Prove(k K) {
	if e, ok := t.live[k]; ok {
		e.proven = true
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
	if !busy {
		t.seq++
		e.since, e.seq = now, t.seq
	}
}

// Gone forgets k; a key it does not hold is ignored.
func (t *Table[K]) Gone(k K) {
	e, ok := t.live[k]
	if !ok {
		return
	}
	delete(t.live, k)
	if t.peers[e.peer]--; t.peers[e.peer] == 0 {
		delete(t.peers, e.peer)
	}
}

// Max is the cap on connections.
func (t *Table[K]) Max() int { return t.max }

// Len is the number of live connections.
func (t *Table[K]) Len() int { return len(t.live) }

func (t *Table[K]) unproven(e *entry, now time.Time) bool {
	return !e.proven && !e.busy && (t.young <= 0 || now.Sub(e.since) < t.young)
}

func (e *entry) before(o *entry) bool {
	return e.since.Before(o.since) || e.since.Equal(o.since) && e.seq < o.seq
}

// unprovenOf is how many unproven connections peer holds.
func (t *Table[K]) unprovenOf(peer string, now time.Time) int {
	n := 0
	for _, e := range t.live {
		if e.peer == peer && t.unproven(e, now) {
			n++
		}
	}
	return n
}

// mostUnproven is the address holding the most unproven connections, the
// one a flood comes from; on a tie, the one whose oldest waited longest.
func (t *Table[K]) mostUnproven(now time.Time) string {
	count := map[string]int{}
	oldest := map[string]*entry{}
	for _, e := range t.live {
		if !t.unproven(e, now) {
			continue
		}
		count[e.peer]++
		if o := oldest[e.peer]; o == nil || e.before(o) {
			oldest[e.peer] = e
		}
	}
	best := ""
	for p, n := range count {
		if best == "" || n > count[best] || n == count[best] && oldest[p].before(oldest[best]) {
			best = p
		}
	}
	return best
}
