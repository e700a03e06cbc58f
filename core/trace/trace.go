package trace

import (
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	_ "unsafe" // for go:linkname
)

// Hop is one step of the ready path, as the Go side sees it. Python's
// hops (ecmooncake.trace) share the names.
type Hop uint8

// The Go hops, in the order an item meets them on a plane that completes
// by message (shm, mooncake). Over TCP the item is ready at the shard
// before the producer sees its write end, and no complete is sent; over
// cuda_ipc the shard sees the item's ready word (ReadyWordSeen) and marks
// it ready, and no complete is sent either.
const (
	ReserveSent      Hop = iota + 1 // producer: reserve_batch sent for the item
	ReserveAnswered                 // producer: its grant came back
	WriteEnqueued                   // producer: the item's write handed to the data plane
	WriteEnded                      // producer: the data plane says the write ended (host side; cuda_ipc: after its copy's event completed)
	CompleteSent                    // producer: complete_batch sent
	CompleteAnswered                // producer: complete_batch answered
	Ready                           // shard: region READY, readiness published
	EventDelivered                  // PD scheduler: the shard's ready event applied
	// ReadyWordSeen is the shard seeing a cuda_ipc write's ready word
	// (the word the producer's GPU stored after the copies), just before
	// it marks the region READY: it comes between WriteEnqueued and Ready,
	// and such a write sends no complete. Numbered last, so that the
	// hops before it keep their numbers.
	ReadyWordSeen
	// ReserveReceived and ReserveReplied are the shard's handler of a
	// reserve_batch: taken, and its grants made with the reply about to
	// go. They split the producer's reserve round trip into the way in,
	// the handling and the way back.
	ReserveReceived
	ReserveReplied
	// SourcesEntered and SourcesChecked are the producer's hand-over in
	// the library: its batch decoded, then its GPU sources checked and
	// their readiness events recorded. They split Python's hand_over ->
	// WriteEnqueued into the crossing, the driver's checks and the
	// producer's step.
	SourcesEntered
	SourcesChecked
	// WriteStarted is the data plane's Start returning in the hand-over
	// (transport.Starter; cuda_ipc): the items announced to the shard and
	// their copies and ready words queued. It splits WriteEnqueued ->
	// WriteEnded into what the hand-over's thread spends starting the
	// write and what the copy and its wait take after.
	WriteStarted
	hopEnd
)

var names = [...]string{
	ReserveSent:      "reserve_sent",
	ReserveAnswered:  "reserve_answered",
	WriteEnqueued:    "write_enqueued",
	WriteEnded:       "write_ended",
	CompleteSent:     "complete_sent",
	CompleteAnswered: "complete_answered",
	Ready:            "ready",
	EventDelivered:   "event_delivered",
	ReadyWordSeen:    "ready_word_seen",
	ReserveReceived:  "reserve_received",
	ReserveReplied:   "reserve_replied",
	SourcesEntered:   "sources_entered",
	SourcesChecked:   "sources_checked",
	WriteStarted:     "write_started",
}

func (h Hop) String() string {
	if h == 0 || h >= hopEnd {
		return "hop(" + strconv.Itoa(int(h)) + ")"
	}
	return names[h]
}

// Env turns tracing on at start: its value is the ring's capacity.
const Env = "ECMOONCAKE_TRACE"

// DefaultCapacity is the ring's size for ECMOONCAKE_TRACE=1.
const DefaultCapacity = 1 << 16

// MaxCapacity bounds a ring (about 40 bytes an entry).
const MaxCapacity = 1 << 22

// Entry is one stamp: the hop, the item (its mm_hash) and CLOCK_MONOTONIC
// in nanoseconds.
type Entry struct {
	Hop Hop
	Key string
	NS  int64
}

type ring struct {
	mu      sync.Mutex
	buf     []Entry
	next    uint64 // entries ever written
	dropped uint64 // entries overwritten before a Drain read them
	read    uint64 // next[at the last Drain]
}

var current atomic.Pointer[ring]

// nanotime is the runtime's clock: CLOCK_MONOTONIC on Linux, read through
// the vDSO (no system call), the clock Python's time.monotonic_ns reads.
// The runtime keeps this name linkable for packages outside it.
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

func init() {
	if n, ok := capacityFromEnv(os.Getenv(Env)); ok {
		Enable(n)
	}
}

// capacityFromEnv reads ECMOONCAKE_TRACE: empty or "0" is off, "1" the
// default capacity, a larger number that capacity.
func capacityFromEnv(v string) (int, bool) {
	if v == "" {
		return 0, false
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, false
	}
	if n == 1 {
		n = DefaultCapacity
	}
	return n, true
}

// Now is CLOCK_MONOTONIC in nanoseconds, the clock of every stamp.
func Now() int64 { return nanotime() }

// Enable starts a fresh ring of n entries (bounded by MaxCapacity); n <= 0
// turns tracing off. Stamps of the old ring are dropped.
func Enable(n int) {
	if n <= 0 {
		current.Store(nil)
		return
	}
	if n > MaxCapacity {
		n = MaxCapacity
	}
	current.Store(&ring{buf: make([]Entry, n)})
}

// Enabled says whether stamps are recorded.
func Enabled() bool { return current.Load() != nil }

// Capacity is the ring's size, 0 when off.
func Capacity() int {
	if r := current.Load(); r != nil {
		return len(r.buf)
	}
	return 0
}

// Stamp records hop h of the item key now, when tracing is on.
func Stamp(h Hop, key string) {
	r := current.Load()
	if r == nil {
		return
	}
	r.add(h, key, Now())
}

// StampAll records hop h of several items at one time.
func StampAll[T any](h Hop, items []T, key func(T) string) {
	r := current.Load()
	if r == nil {
		return
	}
	now := Now()
	for _, it := range items {
		r.add(h, key(it), now)
	}
}

func (r *ring) add(h Hop, key string, ns int64) {
	r.mu.Lock()
	if r.next-r.read >= uint64(len(r.buf)) {
		r.dropped++
		r.read++
	}
	r.buf[r.next%uint64(len(r.buf))] = Entry{Hop: h, Key: key, NS: ns}
	r.next++
	r.mu.Unlock()
}

// Snapshot is what Drain took out of the ring.
type Snapshot struct {
	Capacity int
	// Dropped counts entries overwritten, oldest first, since the last
	// Drain: a trace that lost some says so.
	Dropped uint64
	Entries []Entry
}

// Drain takes the entries written since the last Drain, oldest first.
func Drain() Snapshot {
	r := current.Load()
	if r == nil {
		return Snapshot{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := Snapshot{Capacity: len(r.buf), Dropped: r.dropped, Entries: make([]Entry, 0, r.next-r.read)}
	for i := r.read; i < r.next; i++ {
		out.Entries = append(out.Entries, r.buf[i%uint64(len(r.buf))])
	}
	r.read, r.dropped = r.next, 0
	return out
}
