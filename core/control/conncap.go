package control

import (
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/internal/conncap"
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
// of the newcomer's own address goes first when it has another, else the
// oldest of the peer address with the most young connections: a real
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
// The decision is the rule every open port shares (conncap), a pure
// function of the live set and the clock; the shutdown is the owner's. Events are read a little after they happen, so
// a descriptor in the live set may have been closed and reused already:
// the owner shuts one down only if it is still a TCP socket on this
// server's port, which bounds a mistake to another connection of the same
// socket.
type connCap struct {
	now func() time.Time

	mu      sync.Mutex
	table   *conncap.Table[int] // by descriptor
	evicted uint64
}

// Why a connection was shut down (ecm_failures_total reasons).
const (
	capTotal = conncap.Total
	capPeer  = conncap.Peer
)

func newConnCap(max, perPeer int) *connCap {
	// A margin over the deadline for the monitor's lag.
	return &connCap{now: time.Now, table: conncap.New[int](max, perPeer, handshakeTimeout+time.Second)}
}

// accepted records fd, a connection from peer, and returns the
// descriptor to shut down to stay within the cap and why, if any.
func (c *connCap) accepted(fd int, peer string) (victim int, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if victim, why = c.table.Accepted(fd, peer, c.now()); why != "" {
		c.evicted++
	}
	return victim, why
}

// gone forgets fd.
func (c *connCap) gone(fd int) {
	c.mu.Lock()
	c.table.Gone(fd)
	c.mu.Unlock()
}

func (c *connCap) stats() (live int, evicted uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.table.Len(), c.evicted
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
