package capi

import (
	"fmt"
	"sync"
)

type closer interface{ Close() error }

type handleTable struct {
	mu   sync.Mutex
	next uint64
	objs map[uint64]closer
}

var handles = handleTable{objs: map[uint64]closer{}}

func (t *handleTable) add(o closer) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.objs[t.next] = o
	return t.next
}

func (t *handleTable) get(h uint64) (closer, error) { return t.find(h, false) }

// remove takes the object out of the table first, so that a concurrent
// call with the same handle fails cleanly instead of racing the close.
func (t *handleTable) remove(h uint64) (closer, error) { return t.find(h, true) }

func (t *handleTable) find(h uint64, remove bool) (closer, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o, ok := t.objs[h]
	if !ok {
		return nil, statusErr(StatusHandle, "handle %d is not open (never opened, or already closed)", h)
	}
	if remove {
		delete(t.objs, h)
	}
	return o, nil
}

// lookup returns the object behind h as a T, or a handle error naming the
// kind that was expected.
func lookup[T closer](h uint64, kind string) (T, error) {
	var zero T
	o, err := handles.get(h)
	if err != nil {
		return zero, err
	}
	v, ok := o.(T)
	if !ok {
		return zero, statusErr(StatusHandle, "handle %d is a %s, not a %s", h, kindOf(o), kind)
	}
	return v, nil
}

func kindOf(o closer) string {
	switch o.(type) {
	case *consumerObj:
		return "consumer"
	case *producerObj:
		return "producer"
	case *schedulerObj:
		return "scheduler"
	default:
		return fmt.Sprintf("%T", o)
	}
}
