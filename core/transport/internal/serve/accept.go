package serve

import (
	"errors"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/due"
)

// Acceptor is the accept loop every receiver runs, whatever its socket:
// it takes connections until the listener closes and hands each to Admit.
// An Accept that fails otherwise is retried after a wait that doubles from
// 5ms to 1s, since running out of descriptors must not end the listener
// (as in net/http); a panic in Accept costs that connection, not the loop.
type Acceptor[C net.Conn] struct {
	// Accept takes the next connection; Tune, if set, readies it.
	Accept func() (C, error)
	Tune   func(C)
	// Admit serves c (on a goroutine of its own) or refuses it; false
	// says the receiver is closing and ends the loop.
	Admit func(c C) bool
	// Failed reports an accept failure that will be retried.
	Failed func(err error, retryIn time.Duration)
	// Done, closed, ends the loop, even in the middle of a wait.
	Done <-chan struct{}
	Log  *slog.Logger
}

// Run runs the loop; it returns when the listener or Done closes.
func (a Acceptor[C]) Run() {
	var backoff time.Duration
	for {
		c, ok, err := a.acceptOne()
		if err != nil {
			if a.closing() || errors.Is(err, net.ErrClosed) {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			a.Failed(err, backoff)
			if !due.Sleep(a.Done, backoff) {
				return
			}
			continue
		}
		backoff = 0
		if ok && !a.Admit(c) {
			return
		}
	}
}

func (a Acceptor[C]) closing() bool {
	select {
	case <-a.Done:
		return true
	default:
		return false
	}
}

// acceptOne reports ok=false, with no error, for a connection lost to a
// panic.
func (a Acceptor[C]) acceptOne() (c C, ok bool, err error) {
	defer func() {
		if p := recover(); p != nil {
			LogPanic(a.Log, p, "transport: panic in accept")
			if ok {
				_ = c.Close()
			}
			ok, err = false, nil
		}
	}()
	if c, err = a.Accept(); err != nil {
		return c, false, err
	}
	ok = true
	if a.Tune != nil {
		a.Tune(c)
	}
	return c, true, nil
}

// conn is a connection type that can key a map.
type conn interface {
	net.Conn
	comparable
}

// Conns is the set of connections a receiver serves, at most Max at once,
// and the goroutines that serve them: with Acceptor, the whole life of a
// receiver's connections. The zero value is not usable; see NewConns.
type Conns[C conn] struct {
	max  int
	done chan struct{}
	wg   sync.WaitGroup

	mu      sync.Mutex
	closing bool
	set     map[C]struct{}
}

// NewConns returns an empty set that admits at most max connections.
func NewConns[C conn](max int) *Conns[C] {
	return &Conns[C]{max: max, done: make(chan struct{}), set: make(map[C]struct{})}
}

// Done is closed once Close begins: an Acceptor's Done.
func (s *Conns[C]) Done() <-chan struct{} { return s.done }

// Go runs f on a goroutine that Wait waits for (the accept loop).
func (s *Conns[C]) Go(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
}

// Admit runs serve(c) on a goroutine of its own, and closes c and takes it
// out of the set when serve returns; with Max connections open it calls
// refuse(c) instead (which must close c). It reports false, having closed
// c, once Close has begun: an Acceptor's Admit.
func (s *Conns[C]) Admit(c C, serve, refuse func(C)) bool {
	s.mu.Lock()
	switch {
	case s.closing:
		s.mu.Unlock()
		_ = c.Close()
		return false
	case len(s.set) >= s.max:
		s.mu.Unlock()
		refuse(c)
		return true
	}
	s.set[c] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer func() {
			_ = c.Close()
			s.mu.Lock()
			delete(s.set, c)
			s.mu.Unlock()
			s.wg.Done()
		}()
		serve(c)
	}()
	return true
}

// Close refuses new connections and cuts every open one; it may be called
// more than once.
func (s *Conns[C]) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return
	}
	s.closing = true
	close(s.done)
	for c := range s.set {
		_ = c.Close()
	}
}

// Wait waits until every goroutine started by Go and Admit has returned.
func (s *Conns[C]) Wait() { s.wg.Wait() }

// LogPanic logs p, what recover returned in a goroutine of a data plane,
// at Error with the stack: a panic serving one peer costs that peer's
// work and a log line, not the process.
func LogPanic(log *slog.Logger, p any, msg string, args ...any) {
	log.Error(msg, append(args, "panic", p, "stack", string(debug.Stack()))...)
}

// Counts are counters by reason, safe for concurrent use: the Rejected
// and Closed maps of RecvStats. The zero value is ready.
type Counts struct {
	mu sync.Mutex
	m  map[string]uint64
}

// Add counts one more of reason.
func (c *Counts) Add(reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[string]uint64)
	}
	c.m[reason]++
}

// Snapshot returns a copy, never nil.
func (c *Counts) Snapshot() map[string]uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]uint64, len(c.m))
	for k, v := range c.m {
		out[k] = v
	}
	return out
}

// ClipMsg is msg cut to at most max bytes, the room a wire message gives
// an error's text.
func ClipMsg(msg string, max int) string {
	if len(msg) > max {
		return msg[:max]
	}
	return msg
}
