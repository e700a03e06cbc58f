package metadata

import (
	"net"
	"sync"
)

// connSet holds the store's open connections, so that Close can end the
// ones fasthttp's Shutdown would wait for: it treats a connection that has
// not sent a request yet as busy for its first five seconds, and a request
// still in flight past the grace as long as it lasts.
type connSet struct {
	mu sync.Mutex
	m  map[*trackedConn]struct{}
}

func (s *connSet) add(c *trackedConn) {
	s.mu.Lock()
	if s.m == nil {
		s.m = make(map[*trackedConn]struct{})
	}
	s.m[c] = struct{}{}
	s.mu.Unlock()
}

func (s *connSet) remove(c *trackedConn) {
	s.mu.Lock()
	delete(s.m, c)
	s.mu.Unlock()
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

// trackedListener files each accepted connection in its set until the
// connection closes.
type trackedListener struct {
	net.Listener
	set *connSet
}

func (l trackedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, set: l.set}
	l.set.add(tc)
	return tc, nil
}

type trackedConn struct {
	net.Conn
	set  *connSet
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() { c.set.remove(c) })
	return c.Conn.Close()
}
