package transport

import (
	"log/slog"
	"sync"
	"time"

	"go.uber.org/atomic"
)

// recvCounters backs RecvStats for every receiver implementation.
type recvCounters struct {
	frames, bytes, badConns atomic.Uint64
	rejected, closed        Counts
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

func (c *recvCounters) close(reason string) { c.closed.Add(reason) }

func (c *recvCounters) landed(n uint64) {
	c.frames.Add(1)
	c.bytes.Add(n)
}

func (c *recvCounters) reject(s Status) { c.rejected.Add(s.String()) }

func (c *recvCounters) snapshot() RecvStats {
	return RecvStats{
		Frames:   c.frames.Load(),
		Bytes:    c.bytes.Load(),
		Rejected: c.rejected.Snapshot(),
		BadConns: c.badConns.Load(),
		Closed:   c.closed.Snapshot(),
	}
}

// logEvery is the shortest gap between two log lines from one limiter.
const logEvery = time.Second

// logLimiter keeps a peer that sends garbage or stale frames in a loop from
// flooding the log: one line per logEvery, carrying how many were dropped.
type logLimiter struct {
	mu      sync.Mutex
	last    time.Time
	dropped int
}

func (l *logLimiter) warn(log *slog.Logger, msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if !l.last.IsZero() && now.Sub(l.last) < logEvery {
		l.dropped++
		l.mu.Unlock()
		return
	}
	dropped := l.dropped
	l.last, l.dropped = now, 0
	l.mu.Unlock()
	if dropped > 0 {
		args = append(args, "suppressed", dropped)
	}
	log.Warn(msg, args...)
}
