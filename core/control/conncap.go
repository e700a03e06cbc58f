package control

import (
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// connCap keeps a server socket's connections within a cap. libzmq has
// no such option: it accepts every connection and keeps it until the
// handshake deadline (ZMQ_HANDSHAKE_IVL) or the peer's hang-up. What it
// does offer is the socket monitor, whose ACCEPTED and DISCONNECTED events
// carry the connection's descriptor; every end of an accepted connection,
// a failed handshake included, is reported as DISCONNECTED. From those
// the owner keeps the live set, and at the cap it shuts one down with
// shutdown(2) (never close: the descriptor stays libzmq's, which then
// sees the connection end and reports it).
//
// Which one goes: a connection older than the handshake deadline has
// completed its handshake (libzmq closes it otherwise), so under a secret
// it belongs to a holder of it and stays. Of the younger ones, the oldest
// goes first: a real peer's handshake takes milliseconds, so it is young
// only briefly, while a silent flood fills the young set with connections
// that have waited longest. When every other connection is proven, the
// newcomer is the one refused.
//
// The decision is a pure function of the live set and the clock; the
// shutdown is the owner's. Events are read a little after they happen, so
// a descriptor in the live set may have been closed and reused already:
// the owner shuts one down only if it is still a TCP socket on this
// server's port, which bounds a mistake to another connection of the same
// socket.
type connCap struct {
	max   int
	young time.Duration
	now   func() time.Time

	mu      sync.Mutex
	live    map[int]time.Time // descriptor → when its ACCEPTED was read
	evicted uint64
}

func newConnCap(max int) *connCap {
	// A margin over the deadline for the monitor's lag.
	return &connCap{max: max, young: handshakeTimeout + time.Second, now: time.Now, live: map[int]time.Time{}}
}

// accepted records fd and returns the descriptor to shut down to stay
// within the cap, if any.
func (c *connCap) accepted(fd int) (victim int, evict bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	c.live[fd] = now
	if len(c.live) <= c.max {
		return 0, false
	}
	victim, oldest := fd, now
	for f, at := range c.live {
		if now.Sub(at) < c.young && at.Before(oldest) {
			victim, oldest = f, at
		}
	}
	delete(c.live, victim)
	c.evicted++
	return victim, true
}

// gone forgets fd.
func (c *connCap) gone(fd int) {
	c.mu.Lock()
	delete(c.live, fd)
	c.mu.Unlock()
}

func (c *connCap) stats() (live int, evicted uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.live), c.evicted
}

// shutdownConn ends the accepted connection fd if it is still a TCP
// socket on port. Owner only.
func shutdownConn(fd, port int) error {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return fmt.Errorf("getsockname: %w", err)
	}
	local := -1
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		local = a.Port
	case *unix.SockaddrInet6:
		local = a.Port
	}
	if local != port {
		return fmt.Errorf("descriptor %d is no longer a connection of port %d", fd, port)
	}
	metrics.Failed("control", "conn_cap")
	return unix.Shutdown(fd, unix.SHUT_RDWR)
}
