package slab

import (
	"errors"
	"fmt"
	"sort"
)

// Align is the granularity of every offset and length the allocator hands out.
const Align = 256

// Sentinel errors; callers test them with errors.Is.
var (
	// ErrFull: no free extent is large enough for the request.
	ErrFull = errors.New("slab full")
	// ErrNotAllocated: the offset or range is not a live allocation.
	ErrNotAllocated = errors.New("not allocated")
	// ErrZeroSize: a request for zero bytes.
	ErrZeroSize = errors.New("zero size")
)

type extent struct{ off, len uint64 }

func (e extent) end() uint64 { return e.off + e.len }

// Allocator is a first-fit allocator over [0, size). It is not safe for
// concurrent use.
type Allocator struct {
	size  uint64
	inUse uint64
	// free is sorted by offset and coalesced: no two entries touch.
	free []extent
	live map[uint64]uint64 // offset -> rounded length
}

// NewAllocator manages size bytes, rounded down to Align.
func NewAllocator(size uint64) *Allocator {
	size -= size % Align
	a := &Allocator{size: size, live: make(map[uint64]uint64)}
	if size > 0 {
		a.free = []extent{{0, size}}
	}
	return a
}

// Alloc reserves n bytes (rounded up to Align) at the lowest offset that fits.
func (a *Allocator) Alloc(n uint64) (off uint64, err error) {
	off, ok, err := a.TryAlloc(n)
	switch {
	case err != nil:
		return 0, err
	case !ok:
		return 0, fmt.Errorf("slab: alloc %d bytes: %w (largest free extent %d bytes, %d of %d bytes in use)",
			n, ErrFull, a.LargestFree(), a.inUse, a.size)
	}
	return off, nil
}

// TryAlloc is Alloc that says "full" with ok false and a nil error: a
// caller with a remedy for a full slab (the shard's table evicts resident
// copies) learns it for nothing, where Alloc's message costs a pass over
// the free extents and a format. err is for any other cause.
func (a *Allocator) TryAlloc(n uint64) (off uint64, ok bool, err error) {
	if n == 0 {
		return 0, false, fmt.Errorf("slab: alloc: %w", ErrZeroSize)
	}
	// Checked before rounding so that rounding can never overflow.
	if n > a.size {
		return 0, false, nil
	}
	need := roundUp(n)
	for i := range a.free {
		e := &a.free[i]
		if e.len < need {
			continue
		}
		off = e.off
		if e.len == need {
			a.free = append(a.free[:i], a.free[i+1:]...)
		} else {
			e.off += need
			e.len -= need
		}
		a.live[off] = need
		a.inUse += need
		return off, true, nil
	}
	return 0, false, nil
}

// Free returns the allocation that starts at off, merging it with free
// neighbours on both sides.
func (a *Allocator) Free(off uint64) error {
	n, ok := a.live[off]
	if !ok {
		return fmt.Errorf("slab: free offset %d: %w", off, ErrNotAllocated)
	}
	delete(a.live, off)
	a.inUse -= n

	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > off })
	mergeLeft := i > 0 && a.free[i-1].end() == off
	mergeRight := i < len(a.free) && a.free[i].off == off+n
	switch {
	case mergeLeft && mergeRight:
		a.free[i-1].len += n + a.free[i].len
		a.free = append(a.free[:i], a.free[i+1:]...)
	case mergeLeft:
		a.free[i-1].len += n
	case mergeRight:
		a.free[i].off = off
		a.free[i].len += n
	default:
		a.free = append(a.free, extent{})
		copy(a.free[i+1:], a.free[i:])
		a.free[i] = extent{off, n}
	}
	return nil
}

// InUse is the sum of the rounded lengths of the live allocations.
func (a *Allocator) InUse() uint64 { return a.inUse }

// Size is the managed size (a multiple of Align).
func (a *Allocator) Size() uint64 { return a.size }

// LargestFree is the largest request that would succeed now.
func (a *Allocator) LargestFree() uint64 {
	var m uint64
	for _, e := range a.free {
		m = max(m, e.len)
	}
	return m
}

// Allocations is the number of live allocations.
func (a *Allocator) Allocations() int { return len(a.live) }

// Len is the rounded length of the allocation that starts at off.
func (a *Allocator) Len(off uint64) (uint64, bool) {
	n, ok := a.live[off]
	return n, ok
}

// allocated reports whether [off, off+n) touches no free byte, that is,
// whether it lies entirely inside live allocations. The caller has checked
// that the range lies inside [0, size).
func (a *Allocator) allocated(off, n uint64) bool {
	end := off + n
	// The first free extent that ends after off is the only one that can
	// overlap the range, because the extents are sorted and disjoint.
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].end() > off })
	return i == len(a.free) || a.free[i].off >= end
}

func roundUp(n uint64) uint64 { return (n + Align - 1) &^ (Align - 1) }

// Split cuts the live allocation that starts at off in two at at: [off, at)
// and [at, end) become two allocations that are freed apart. at must be a
// multiple of Align strictly inside the allocation. It moves no byte and
// changes neither InUse nor any free extent: the reservation table uses it
// to turn part of a producer's credit window into a region of its own.
func (a *Allocator) Split(off, at uint64) error {
	n, ok := a.live[off]
	switch {
	case !ok:
		return fmt.Errorf("slab: split offset %d: %w", off, ErrNotAllocated)
	case at%Align != 0 || at <= off || at >= off+n:
		return fmt.Errorf("slab: split [%d,+%d) at %d: %w", off, n, at, ErrNotAllocated)
	}
	a.live[off] = at - off
	a.live[at] = off + n - at
	return nil
}
