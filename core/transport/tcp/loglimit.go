package tcp

import (
	"log/slog"
	"sync"
	"time"
)

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
