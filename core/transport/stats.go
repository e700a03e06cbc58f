package transport

import (
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// RecvCounters backs RecvStats for every receiver implementation. The
// zero value is ready.
type RecvCounters struct {
	frames, bytes, badConns atomic.Uint64
	rejected, closed        serve.Counts
}

// Reasons a receiver closes a connection to protect itself, the keys of
// RecvStats.Closed.
const (
	ClosedLimit        = "limit"         // at MaxConns with none idle
	ClosedEvicted      = "evicted"       // idle, and a new connection needed its slot
	ClosedIdle         = "idle"          // no frame for IdleTimeout
	ClosedFrameTimeout = "frame_timeout" // a frame not done within FrameTimeout
	// Connections that had not proven themselves (see Mode).
	ClosedHandshakeTimeout = "handshake_timeout" // no proof within HandshakeTimeout
	ClosedUnprovenEvicted  = "unproven_evicted"  // at MaxUnproven, a newcomer needed its place
	ClosedNotAdmitted      = "not_admitted"      // a bad or missing proof, or another protocol
)

// Close counts a connection closed for reason, one of the Closed* keys.
func (c *RecvCounters) Close(reason string) { c.closed.Add(reason) }

// Landed counts one frame of n bytes that reached the sink whole.
func (c *RecvCounters) Landed(n uint64) {
	c.frames.Add(1)
	c.bytes.Add(n)
}

// Reject counts one frame refused with s.
func (c *RecvCounters) Reject(s Status) { c.rejected.Add(s.String()) }

// BadConn counts one connection closed for bytes that broke the protocol.
func (c *RecvCounters) BadConn() { c.badConns.Add(1) }

// Snapshot is the counts so far.
func (c *RecvCounters) Snapshot() RecvStats {
	return RecvStats{
		Frames:   c.frames.Load(),
		Bytes:    c.bytes.Load(),
		Rejected: c.rejected.Snapshot(),
		BadConns: c.badConns.Load(),
		Closed:   c.closed.Snapshot(),
	}
}
