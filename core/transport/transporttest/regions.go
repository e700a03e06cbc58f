package transporttest

import (
	"fmt"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Regions is a reservation table for transport tests. Over host memory it
// is a Sink that hands out views of the slab; over device memory it is a
// RegionSink that hands out offsets. It refuses frames the way a shard
// does (unknown reservation, bad token, outside the region) and counts
// frames so that a test can check that every one that began also ended.
type Regions struct {
	salt    byte // tells one table's tokens from another's
	mu      sync.Mutex
	host    []byte // nil over device memory
	size    uint64
	next    uint64
	nextID  ids.ResID
	regions map[ids.ResID]*region
	begun   int
	ended   int
	// completed counts CompleteRemote's completions
	completed int
}

type region struct {
	tok      ids.Token
	off, n   uint64
	inflight int
	torn     bool
	gone     bool
	done     bool // completed by CompleteRemote
}

var tables atomic.Uint32

// NewHost is a table over a host slab of size bytes.
func NewHost(size int) *Regions {
	return &Regions{salt: byte(tables.Add(1)), host: make([]byte, size), size: uint64(size), regions: map[ids.ResID]*region{}}
}

// NewDevice is a table over a device slab of size bytes that the test
// owns; frames come through BeginRegion.
func NewDevice(size uint64) *Regions {
	return &Regions{salt: byte(tables.Add(1)), size: size, regions: map[ids.ResID]*region{}}
}

var (
	_ transport.RemoteSink = (*Regions)(nil)
	_ transport.RegionSink = (*Regions)(nil)
	_ transport.Sink       = (*Regions)(nil)
)

// Reserve makes a region of n bytes (aligned to 256) and its token.
func (r *Regions) Reserve(n uint64) (ids.ResID, ids.Token) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.next+n > r.size {
		panic(fmt.Sprintf("transporttest: slab of %d bytes full", r.size))
	}
	r.nextID++
	tok := ids.Token{byte(r.nextID), 0xec, byte(r.nextID >> 8), r.salt}
	r.regions[r.nextID] = &region{tok: tok, off: r.next, n: n}
	r.next += (n + 255) &^ 255
	return r.nextID, tok
}

// Offset is where a region starts in the slab.
func (r *Regions) Offset(res ids.ResID) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.regions[res].off
}

// Host is the host slab (nil over device memory).
func (r *Regions) Host() []byte { return r.host }

// Drop makes a region refuse later frames as gone.
func (r *Regions) Drop(res ids.ResID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.regions[res].gone = true
}

// Torn reports whether a frame of the region ended without all its bytes.
func (r *Regions) Torn(res ids.ResID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.regions[res].torn
}

// Balance fails unless every frame that began has ended.
func (r *Regions) Balance() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.begun != r.ended {
		return fmt.Errorf("transporttest: %d frames began, %d ended", r.begun, r.ended)
	}
	for id, g := range r.regions {
		if g.inflight != 0 {
			return fmt.Errorf("transporttest: region %d has %d frames open", id, g.inflight)
		}
	}
	return nil
}

// Frames is the number of frames that began.
func (r *Regions) Frames() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.begun
}

func (r *Regions) admit(res ids.ResID, tok ids.Token, off, n uint64) (uint64, error) {
	g, ok := r.regions[res]
	switch {
	case !ok:
		return 0, fmt.Errorf("region %d: %w", res, transport.ErrUnknownRes)
	case !tok.Equal(g.tok):
		return 0, fmt.Errorf("region %d: %w", res, transport.ErrBadToken)
	case g.gone:
		return 0, fmt.Errorf("region %d: %w", res, transport.ErrGone)
	case n == 0 || off > g.n || n > g.n-off:
		return 0, fmt.Errorf("region %d: [%d,+%d) of %d bytes: %w", res, off, n, g.n, transport.ErrOutOfBounds)
	}
	g.inflight++
	r.begun++
	return g.off + off, nil
}

// BeginWrite implements transport.Sink over a host slab.
func (r *Regions) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.host == nil {
		return nil, fmt.Errorf("transporttest: a device slab has no host view")
	}
	at, err := r.admit(res, tok, off, n)
	if err != nil {
		return nil, err
	}
	return r.host[at : at+n : at+n], nil
}

// BeginRegion implements transport.RegionSink.
func (r *Regions) BeginRegion(res ids.ResID, tok ids.Token, off, n uint64) (uint64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.admit(res, tok, off, n)
}

// EndWrite implements transport.Sink.
func (r *Regions) EndWrite(res ids.ResID, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g := r.regions[res]
	if g == nil || g.inflight == 0 {
		panic(fmt.Sprintf("transporttest: EndWrite(%d) without a frame open", res))
	}
	g.inflight--
	r.ended++
	if !ok {
		g.torn = true
	}
}

// RemoteGrace is how long after WatchRemote a one-sided write stays open
// in this table (a shard's writer grace).
const RemoteGrace = time.Minute

// WatchRemote implements transport.RemoteSink: every region that is not
// gone nor completed is an open one-sided write.
func (r *Regions) WatchRemote(res ids.ResID, tok ids.Token) (time.Time, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.openRemote(res, tok); err != nil {
		return time.Time{}, err
	}
	return time.Now().Add(RemoteGrace), nil
}

// CompleteRemote implements transport.RemoteSink.
func (r *Regions) CompleteRemote(res ids.ResID, tok ids.Token) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, err := r.openRemote(res, tok)
	if err != nil {
		return err
	}
	g.done = true
	r.completed++
	return nil
}

func (r *Regions) openRemote(res ids.ResID, tok ids.Token) (*region, error) {
	g, ok := r.regions[res]
	switch {
	case !ok:
		return nil, fmt.Errorf("region %d: %w", res, transport.ErrUnknownRes)
	case !tok.Equal(g.tok):
		return nil, fmt.Errorf("region %d: %w", res, transport.ErrBadToken)
	case g.gone || g.done:
		return nil, fmt.Errorf("region %d: %w", res, transport.ErrGone)
	}
	return g, nil
}

// Completed reports whether CompleteRemote completed the region.
func (r *Regions) Completed(res ids.ResID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.regions[res].done
}

// Completions counts the regions CompleteRemote completed.
func (r *Regions) Completions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.completed
}
