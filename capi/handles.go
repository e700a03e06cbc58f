package capi

import "sync"

type closer interface{ Close() error }

// object is what the handle table holds: an open object that can name
// its kind and report its counters.
type object interface {
	closer
	kind() string
	stats() any
}

// kind is one kind of object that crosses the boundary as a handle.
type kind[T closer] struct {
	name  string
	stats func(T) any
}

// held is an open T in the handle table.
type held[T closer] struct {
	v T
	k *kind[T]
}

func (o held[T]) Close() error { return o.v.Close() }
func (o held[T]) kind() string { return o.k.name }
func (o held[T]) stats() any   { return o.k.stats(o.v) }

// add puts an open T in the table and returns its handle.
func (k *kind[T]) add(v T) uint64 { return handles.add(held[T]{v, k}) }

// get returns the T behind h, or a handle error naming the kind that was
// expected.
func (k *kind[T]) get(h uint64) (T, error) {
	var zero T
	o, err := handles.get(h)
	if err != nil {
		return zero, err
	}
	v, ok := o.(held[T])
	if !ok {
		return zero, statusErr(StatusHandle, "handle %d is a %s, not a %s", h, o.kind(), k.name)
	}
	return v.v, nil
}

type handleTable struct {
	mu   sync.Mutex
	next uint64
	objs map[uint64]object
}

var handles = handleTable{objs: map[uint64]object{}}

func (t *handleTable) add(o object) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.objs[t.next] = o
	return t.next
}

func (t *handleTable) get(h uint64) (object, error) { return t.find(h, false) }

// remove takes the object out of the table first, so that a concurrent
// call with the same handle fails cleanly instead of racing the close.
func (t *handleTable) remove(h uint64) (object, error) { return t.find(h, true) }

func (t *handleTable) find(h uint64, remove bool) (object, error) {
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
