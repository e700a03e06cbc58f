package metadata

import (
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/internal/conncap"
)

// connSet holds the store's open connections and keeps them within
// MaxConns, MaxConnsPerPeer of one address, by the rule every open port
// shares (conncap): at a limit, a connection that has not proved itself
// and is not in a request makes room, its address's longest waiting one
// first, so a flood of silent connections makes room from its own. A
// connection proves itself by a request with the token; without a token
// none can, and every idle one may go.
//
// It also lets Close end the connections fasthttp's Shutdown would wait
// for: it treats a connection that has not sent a request yet as busy for
// its first five seconds, and a request still in flight past the grace as
// long as it lasts.
type connSet struct {
	mu    sync.Mutex
	m     map[*trackedConn]struct{}
	table *conncap.Table[*trackedConn]

	evicted, refused atomic.Uint64
}

func newConnSet(max, perPeer int) *connSet {
	return &connSet{m: map[*trackedConn]struct{}{}, table: conncap.New[*trackedConn](max, perPeer, 0)}
}

// add files c and says which connection to close to stay within the
// limits, if any (c itself, when it is refused).
func (s *connSet) add(c *trackedConn, now time.Time) (victim *trackedConn, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[c] = struct{}{}
	victim, why = s.table.Accepted(c, c.peer, now)
	if why != "" {
		// Out of the set now: its Close finds nothing to remove.
		delete(s.m, victim)
	}
	return victim, why
}

func (s *connSet) remove(c *trackedConn) {
	s.mu.Lock()
	delete(s.m, c)
	s.table.Gone(c)
	s.mu.Unlock()
}

// busy marks c as in a request (never chosen to make room), or done with
// one; proven says the request carried the token.
func (s *connSet) busy(c *trackedConn, busy, proven bool, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if proven {
		s.table.Prove(c)
	}
	s.table.Busy(c, busy, now)
}

func (s *connSet) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// closeAll closes every connection still open and says how many.
func (s *connSet) closeAll() int {
	s.mu.Lock()
	open := make([]*trackedConn, 0, len(s.m))
	for c := range s.m {
		open = append(open, c)
	}
	s.mu.Unlock()
	for _, c := range open {
		_ = c.Close()
	}
	return len(open)
}

// refusedReply is what a newcomer past the limits reads before the store
// closes it: every place is held by a proven connection or one in a
// request.
var refusedReply = func() []byte {
	msg := "the metadata store is at its connection cap (max_conns), every place held by an engine; retry"
	return fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n\r\n%s", len(msg), msg)
}()

// refusedWrite bounds the write of refusedReply: it fits a socket's
// buffer, so only a peer that does not read could make it wait, and the
// accept loop must not.
const refusedWrite = 100 * time.Millisecond

// trackedListener files each accepted connection in its set until the
// connection closes, and closes what the set says must go.
type trackedListener struct {
	net.Listener
	set *connSet
	// onVictim counts and logs a connection closed to keep the limits.
	onVictim func(c *trackedConn, why string, refused bool)
}

func (l trackedListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		tc := &trackedConn{Conn: c, set: l.set, peer: hostOf(c.RemoteAddr())}
		victim, why := l.set.add(tc, time.Now())
		switch {
		case why == "":
			return tc, nil
		case victim == tc:
			l.set.refused.Add(1)
			l.onVictim(tc, why, true)
			_ = c.SetWriteDeadline(time.Now().Add(refusedWrite))
			_, _ = c.Write(refusedReply)
			_ = tc.Close()
			continue
		default:
			l.set.evicted.Add(1)
			l.onVictim(victim, why, false)
			// Its fasthttp worker, waiting for a request, sees the close.
			// One whose request header completed in the instant since
			// the choice loses that request: the price of choosing
			// without holding the set's lock across the handler.
			_ = victim.Close()
			return tc, nil
		}
	}
}

// hostOf is a peer's address without its port: what its share counts.
func hostOf(a net.Addr) string {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.IP.String()
	}
	h, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return h
}

type trackedConn struct {
	net.Conn
	set  *connSet
	peer string
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() { c.set.remove(c) })
	return c.Conn.Close()
}
