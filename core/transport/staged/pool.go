package staged

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

// errPoolClosed: the pool was closed while a caller waited for a buffer.
var errPoolClosed = errors.New("staging pool closed")

// pool lends page-locked buffers within a byte budget. Allocating
// page-locked memory is slow (the kernel pins every page), so buffers are
// kept and reused; a buffer too small for the next request is freed only
// when the budget needs its bytes.
type pool struct {
	limit int
	round int // allocations are rounded up to a multiple of this

	mu     sync.Mutex
	free   []gpu.HostMem
	total  int // bytes allocated, free and lent
	closed bool
	back   chan struct{} // closed and replaced when a buffer returns
}

func newPool(limit, round int) *pool {
	return &pool{limit: limit, round: max(round, 1), back: make(chan struct{})}
}

// get returns a buffer of at least n bytes: the smallest free one that
// fits, else a new one from dev while the budget allows (always when the
// pool holds nothing, so that a budget below one buffer cannot deadlock).
// When neither is possible it waits for a buffer to come back if wait is
// set, and returns nil otherwise.
func (p *pool) get(ctx context.Context, dev gpu.Device, n int, wait bool) (gpu.HostMem, error) {
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errPoolClosed
		}
		if m := p.takeLocked(n); m != nil {
			p.mu.Unlock()
			return m, nil
		}
		size := (n + p.round - 1) / p.round * p.round
		room := p.makeRoomLocked(size)
		if room {
			p.total += size
		}
		back := p.back
		p.mu.Unlock()
		if room {
			m, err := dev.AllocHost(size)
			if err != nil {
				p.mu.Lock()
				p.total -= size
				p.mu.Unlock()
				return nil, fmt.Errorf("staging buffer of %d bytes: %w", size, err)
			}
			return m, nil
		}
		if !wait {
			return nil, nil
		}
		select {
		case <-back:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (p *pool) takeLocked(n int) gpu.HostMem {
	best := -1
	for i, m := range p.free {
		if len(m.Bytes()) >= n && (best < 0 || len(m.Bytes()) < len(p.free[best].Bytes())) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	m := p.free[best]
	p.free = append(p.free[:best], p.free[best+1:]...)
	return m
}

// makeRoomLocked reports whether size more bytes fit the budget, freeing
// idle buffers (all of which are too small, or takeLocked would have found
// one) until they do.
func (p *pool) makeRoomLocked(size int) bool {
	for p.total > 0 && p.total+size > p.limit && len(p.free) > 0 {
		m := p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
		p.total -= len(m.Bytes())
		_ = m.Free()
	}
	return p.total == 0 || p.total+size <= p.limit
}

// put returns a buffer from get.
func (p *pool) put(m gpu.HostMem) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.total -= len(m.Bytes())
		_ = m.Free()
		return
	}
	p.free = append(p.free, m)
	close(p.back)
	p.back = make(chan struct{})
}

// close frees the idle buffers now and lent ones as they come back, and
// wakes every waiter.
func (p *pool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	for _, m := range p.free {
		p.total -= len(m.Bytes())
		_ = m.Free()
	}
	p.free = nil
	close(p.back)
}

// bytes is the page-locked memory the pool holds, idle and lent.
func (p *pool) bytes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total
}
