package tcp

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
)

// memSink is the test Sink: one plain byte slice carved into reservations
// kept in a small map, checking what a real reservation table checks and
// recording every call so tests can assert on the Sink contract.
type memSink struct {
	mu     sync.Mutex
	buf    []byte
	used   uint64
	ids    ids.Counter
	res    map[ids.ResID]*memRes
	begins []beginCall
	ends   map[ids.ResID][]bool
	broken []string // contract violations seen
}

type memRes struct {
	tok        ids.Token
	base, size uint64
	gone       bool
	open       int
}

type beginCall struct {
	res    ids.ResID
	off, n uint64
}

func newMemSink(capacity int) *memSink {
	return &memSink{
		buf:  make([]byte, capacity),
		res:  make(map[ids.ResID]*memRes),
		ends: make(map[ids.ResID][]bool),
	}
}

// reserve carves size bytes and returns the reservation's id and token.
func (s *memSink) reserve(t testing.TB, size int) (ids.ResID, ids.Token) {
	t.Helper()
	tok, err := ids.CryptoTokens.NewToken()
	require.NoError(t, err)
	s.mu.Lock()
	defer s.mu.Unlock()
	require.LessOrEqual(t, s.used+uint64(size), uint64(len(s.buf)), "memSink too small")
	id := s.ids.Next()
	s.res[id] = &memRes{tok: tok, base: s.used, size: uint64(size)}
	s.used += uint64(size)
	return id, tok
}

func (s *memSink) region(res ids.ResID) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.res[res]
	return s.buf[r.base : r.base+r.size]
}

func (s *memSink) markGone(res ids.ResID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.res[res].gone = true
}

func (s *memSink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.begins = append(s.begins, beginCall{res, off, n})
	r, ok := s.res[res]
	switch {
	case !ok:
		return nil, fmt.Errorf("memsink: res %d: %w", res, transport.ErrUnknownRes)
	case r.gone:
		return nil, fmt.Errorf("memsink: res %d: %w", res, transport.ErrGone)
	case !r.tok.Equal(tok):
		return nil, fmt.Errorf("memsink: res %d: %w", res, transport.ErrBadToken)
	case off > r.size || n > r.size-off:
		return nil, fmt.Errorf("memsink: res %d: [%d,+%d) of %d: %w", res, off, n, r.size, transport.ErrOutOfBounds)
	}
	r.open++
	lo := r.base + off
	return s.buf[lo : lo+n : lo+n], nil
}

func (s *memSink) EndWrite(res ids.ResID, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.res[res]
	if r == nil || r.open == 0 {
		s.broken = append(s.broken, fmt.Sprintf("EndWrite(%d, %v) without BeginWrite", res, ok))
		return
	}
	r.open--
	s.ends[res] = append(s.ends[res], ok)
}

func (s *memSink) endsOf(res ids.ResID) []bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]bool(nil), s.ends[res]...)
}

func (s *memSink) beginsOf(res ids.ResID) []beginCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []beginCall
	for _, b := range s.begins {
		if b.res == res {
			out = append(out, b)
		}
	}
	return out
}

func (s *memSink) beginCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.begins)
}

// requireBalanced checks the Sink contract once the receiver is closed:
// every successful BeginWrite got exactly one EndWrite.
func (s *memSink) requireBalanced(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Empty(t, s.broken)
	for id, r := range s.res {
		require.Zero(t, r.open, "res %d has a BeginWrite without EndWrite", id)
	}
}

// gateSink holds every BeginWrite until released, so tests can act while
// frames are certainly in flight.
type gateSink struct {
	*memSink
	once    sync.Once
	began   chan struct{}
	release chan struct{}
}

func newGateSink(capacity int) *gateSink {
	return &gateSink{memSink: newMemSink(capacity), began: make(chan struct{}), release: make(chan struct{})}
}

func (g *gateSink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	g.once.Do(func() { close(g.began) })
	<-g.release
	return g.memSink.BeginWrite(res, tok, off, n)
}

func (g *gateSink) open() {
	select {
	case <-g.release:
	default:
		close(g.release)
	}
}

// randBytes returns n reproducible pseudo-random bytes.
func randBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)})
	_, _ = r.Read(b)
	return b
}
