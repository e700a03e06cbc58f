package transporttest

import (
	"context"
	"sync"
)

// Expiring is a context whose deadline passes when the test calls Expire,
// not at a wall-clock time: a test of what a write does when its deadline
// passes picks the step of the write at which it does (after the first
// chunk is in flight, say), where a short timeout would pick it by the
// machine's speed. Its Err is context.DeadlineExceeded once expired, as a
// context.WithTimeout's is; it reports no Deadline, so code that copies
// the deadline to a socket meets it through Done.
type Expiring struct {
	context.Context
	done chan struct{}
	once sync.Once
}

// NewExpiring returns a context that has not expired.
func NewExpiring() *Expiring {
	return &Expiring{Context: context.Background(), done: make(chan struct{})}
}

// Expire makes the deadline pass; idempotent.
func (e *Expiring) Expire() { e.once.Do(func() { close(e.done) }) }

// Done is closed by Expire.
func (e *Expiring) Done() <-chan struct{} { return e.done }

// Err is nil until Expire, then context.DeadlineExceeded.
func (e *Expiring) Err() error {
	select {
	case <-e.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}
