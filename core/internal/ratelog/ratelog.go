package ratelog

import (
	"sync"
	"time"
)

// Interval is how long a reason stays quiet after one of its lines.
const Interval = 10 * time.Second

// Limiter is safe for concurrent use; its zero value is ready.
type Limiter struct {
	mu         sync.Mutex
	last       map[string]time.Time
	suppressed map[string]int
}

// Admit reports whether to log reason now, and how many lines of it were
// left out since its last one.
func (l *Limiter) Admit(reason string, now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last, l.suppressed = map[string]time.Time{}, map[string]int{}
	}
	if t, ok := l.last[reason]; ok && now.Sub(t) < Interval {
		l.suppressed[reason]++
		return false, 0
	}
	n := l.suppressed[reason]
	l.last[reason], l.suppressed[reason] = now, 0
	return true, n
}
