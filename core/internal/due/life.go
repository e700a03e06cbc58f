package due

import (
	"context"
	"sync/atomic"
)

// Life is the lifetime of an object that runs a Loop: it ends once, at the
// object's Close, and that both stops the object's goroutines (Done) and
// ends the calls it has in flight, which run under it as their context.
type Life struct {
	context.Context
	end   context.CancelFunc
	ended atomic.Bool
}

// NewLife begins a life.
func NewLife() *Life {
	l := &Life{}
	l.Context, l.end = context.WithCancel(context.Background())
	return l
}

// End ends the life; false when it had ended already. An object that
// reads Ended under its own lock calls End under that lock too, so that
// whatever it decided while alive was decided before the end.
func (l *Life) End() bool {
	if !l.ended.CompareAndSwap(false, true) {
		return false
	}
	l.end()
	return true
}

// Ended reports whether End has been called.
func (l *Life) Ended() bool { return l.ended.Load() }
