package control

import (
	"sync"

	"go.uber.org/atomic"
)

// callTable holds the calls waiting for their replies, by id: the one place
// a reply meets its caller, for the ZeroMQ client and the Unix one alike.
// While closed it takes no call, and closing it failed every call it
// held.
type callTable struct {
	mu      sync.Mutex
	pending map[uint64]chan result
	closed  error
}

func newCallTable() callTable { return callTable{pending: map[uint64]chan result{}} }

// add registers call id; it fails with the table's closing error instead
// while the table is closed.
func (t *callTable) add(id uint64) (chan result, error) {
	ch := make(chan result, 1)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed != nil {
		return nil, t.closed
	}
	t.pending[id] = ch
	return ch, nil
}

func (t *callTable) forget(id uint64) {
	t.mu.Lock()
	delete(t.pending, id)
	t.mu.Unlock()
}

func (t *callTable) waiting(id uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.pending[id]
	return ok
}

func (t *callTable) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pending)
}

// isClosed reports whether the table refuses calls.
func (t *callTable) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed != nil
}

// deliver hands r to call id; false when nobody waits for it. A reply is
// counted in trips (when not nil and r is no error) before its caller can
// see it, so that a caller holding its reply finds it counted.
func (t *callTable) deliver(id uint64, r result, trips *atomic.Uint64) bool {
	t.mu.Lock()
	ch, ok := t.pending[id]
	delete(t.pending, id)
	t.mu.Unlock()
	if !ok {
		return false
	}
	if trips != nil && r.err == nil {
		trips.Inc()
	}
	ch <- r // buffered, and delivered at most once: never blocks
	return true
}

// refuse makes the table refuse calls with err, the peer's latest
// refusal, and fails every call it holds with it; err nil opens it again.
func (t *callTable) refuse(err error) {
	t.mu.Lock()
	t.closed = err
	var waiting map[uint64]chan result
	if err != nil {
		waiting, t.pending = t.pending, map[uint64]chan result{}
	}
	t.mu.Unlock()
	failAll(waiting, err)
}

// close makes the table refuse calls with err for good and fails every
// call it holds with fail. Only the first close counts: it reports
// whether this was it.
func (t *callTable) close(err, fail error) bool {
	t.mu.Lock()
	if t.closed != nil {
		t.mu.Unlock()
		return false
	}
	t.closed = err
	waiting := t.pending
	t.pending = map[uint64]chan result{}
	t.mu.Unlock()
	failAll(waiting, fail)
	return true
}

func failAll(waiting map[uint64]chan result, err error) {
	for _, ch := range waiting {
		ch <- result{err: err}
	}
}
