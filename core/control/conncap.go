package control

import (
	"fmt"
	"net"
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
// of the peer address with the most young connections goes first: a real
// peer's handshake takes milliseconds, so it is young only briefly, while
// a silent flood fills the young set from its own address, and makes room
// from its own connections, never another address's. When every other
// connection is proven, the newcomer is the one refused.
//
// Each peer address also holds at most perPeer connections (the address
// is read with getpeername(2) on the descriptor when its ACCEPTED is
// read): over its share, that address's oldest young connection goes, or
// the newcomer. So one address cannot take every place; it cannot tell
// same-host peers apart, which share loopback (the Unix path does, by
// uid).
//
// The decision is a pure function of the live set and the clock; the
// shutdown is the owner's. Events are read a little after they happen, so
// a descriptor in the live set may have been closed and reused already:
// the owner shuts one down only if it is still a TCP socket on this
// server's port, which bounds a mistake to another connection of the same
// socket.
type connCap struct {
	max     int
	perPeer int
	young   time.Duration
	now     func() time.Time

	mu      sync.Mutex
	live    map[int]liveConn // by descriptor
	peers   map[string]int   // live connections by peer address
	evicted uint64
}

type liveConn struct {
	at   time.Time // when its ACCEPTED was read
	peer string
}

// Why a connection was shut down (ecm_failures_total reasons).
const (
	capTotal = "conn_cap"
	capPeer  = "conn_cap_peer"
)

func newConnCap(max, perPeer int) *connCap {
	// A margin over the deadline for the monitor's lag.
	return &connCap{max: max, perPeer: perPeer, young: handshakeTimeout + time.Second, now: time.Now,
		live: map[int]liveConn{}, peers: map[string]int{}}
}

// accepted records fd, a connection from peer, and returns the
// descriptor to shut down to stay within the cap and why, if any.
func (c *connCap) accepted(fd int, peer string) (victim int, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	c.forget(fd) // a descriptor reused before its DISCONNECTED was read
	c.live[fd] = liveConn{at: now, peer: peer}
	c.peers[peer]++

	from := peer
	switch {
	case len(c.live) > c.max && c.peers[peer] > c.perPeer:
		why = capTotal
	case len(c.live) > c.max:
		why, from = capTotal, c.mostYoung(now)
	case c.peers[peer] > c.perPeer:
		why = capPeer
	default:
		return 0, ""
	}
	victim = fd
	oldest := now
	for f, l := range c.live {
		if l.peer == from && now.Sub(l.at) < c.young && l.at.Before(oldest) {
			victim, oldest = f, l.at
		}
	}
	c.forget(victim)
	c.evicted++
	return victim, why
}

// forget drops fd from the live set. Under mu.
func (c *connCap) forget(fd int) {
	l, ok := c.live[fd]
	if !ok {
		return
	}
	delete(c.live, fd)
	if c.peers[l.peer]--; c.peers[l.peer] == 0 {
		delete(c.peers, l.peer)
	}
}

// mostYoung is the peer with the most young connections, the one a
// flood comes from. Under mu.
func (c *connCap) mostYoung(now time.Time) string {
	young := map[string]int{}
	best, most := "", 0
	for _, l := range c.live {
		if now.Sub(l.at) >= c.young {
			continue
		}
		young[l.peer]++
		if n := young[l.peer]; n > most || (n == most && l.peer < best) {
			best, most = l.peer, n
		}
	}
	return best
}

// gone forgets fd.
func (c *connCap) gone(fd int) {
	c.mu.Lock()
	c.forget(fd)
	c.mu.Unlock()
}

func (c *connCap) stats() (live int, evicted uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.live), c.evicted
}

// peerOf is the address of the peer at the other end of the accepted
// connection fd, without its port; "" when it cannot be read (the
// connection ended already: its DISCONNECTED follows).
func peerOf(fd int) string {
	sa, err := unix.Getpeername(fd)
	if err != nil {
		return ""
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return net.IP(a.Addr[:]).String()
	case *unix.SockaddrInet6:
		return net.IP(a.Addr[:]).String()
	}
	return ""
}

// shutdownConn ends the accepted connection fd if it is still a TCP
// socket on port, counted under why. Owner only.
func shutdownConn(fd, port int, why string) error {
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
	metrics.Failed("control", why)
	return unix.Shutdown(fd, unix.SHUT_RDWR)
}
