package slab

import (
	"errors"
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/internal/enum"
	"github.com/ecmooncake/ecmooncake/core/internal/machine"
)

var (
	// ErrClosed: the slab no longer allows the operation.
	ErrClosed = errors.New("slab closed")
	// ErrInUse: a non-forced Close while bytes are in use.
	ErrInUse = errors.New("slab in use")
	// ErrBadTransition: an illegal lifecycle move; the sentinel every
	// state machine shares.
	ErrBadTransition = machine.ErrIllegalTransition
)

// State is the lifecycle of a Slab.
type State uint8

const (
	// Open allocates and frees. Next: Closing (forced close with bytes in
	// use) or Closed (close with nothing in use).
	Open State = iota
	// Closing refuses new allocations but still frees. Next: Closed, when
	// the last allocation is freed.
	Closing
	// Closed is final: the owner may release the memory.
	Closed
	numStates
)

var stateNames = [numStates]string{Open: "open", Closing: "closing", Closed: "closed"}

func (s State) String() string { return enum.Name("State", stateNames[:], s) }

var legal = machine.NewEdges(numStates, map[State][]State{
	Open:    {Closing, Closed},
	Closing: {Closed},
})

// Slab is a Memory carved by an Allocator, with a lifecycle.
type Slab struct {
	mem   Memory
	alloc *Allocator
	state State
}

// NewSlab manages m.Len bytes of m, rounded down to Align.
func NewSlab(m Memory) *Slab {
	return &Slab{mem: m, alloc: NewAllocator(m.Len)}
}

// transition is the only place the state changes.
func (s *Slab) transition(to State) error {
	if !legal.Allows(s.state, to) {
		return fmt.Errorf("slab: %s -> %s: %w", s.state, to, ErrBadTransition)
	}
	s.state = to
	return nil
}

// Alloc reserves n bytes; only an Open slab allocates.
func (s *Slab) Alloc(n uint64) (off uint64, err error) {
	if s.state != Open {
		return 0, fmt.Errorf("slab: alloc %d bytes: slab is %s: %w", n, s.state, ErrClosed)
	}
	return s.alloc.Alloc(n)
}

// TryAlloc is Alloc with want of room told apart (Allocator.TryAlloc).
func (s *Slab) TryAlloc(n uint64) (off uint64, ok bool, err error) {
	if s.state != Open {
		return 0, false, fmt.Errorf("slab: alloc %d bytes: slab is %s: %w", n, s.state, ErrClosed)
	}
	return s.alloc.TryAlloc(n)
}

// Split cuts the allocation at off in two at at (Allocator.Split); a
// Closing slab splits too, since no byte changes hands.
func (s *Slab) Split(off, at uint64) error {
	if s.state == Closed {
		return fmt.Errorf("slab: split offset %d: %w", off, ErrClosed)
	}
	return s.alloc.Split(off, at)
}

// Free returns an allocation. A Closing slab becomes Closed with its last Free.
func (s *Slab) Free(off uint64) error {
	if s.state == Closed {
		return fmt.Errorf("slab: free offset %d: %w", off, ErrClosed)
	}
	if err := s.alloc.Free(off); err != nil {
		return err
	}
	if s.state == Closing && s.alloc.Allocations() == 0 {
		return s.transition(Closed)
	}
	return nil
}

// Close ends the slab. Without force it is refused while bytes are in use.
// With force and bytes in use it moves to Closing: no new allocations, and
// Closed once the remaining allocations are freed. Closing a Closed slab,
// or force-closing a Closing one, is a no-op.
func (s *Slab) Close(force bool) error {
	switch {
	case s.state == Closed:
		return nil
	case s.alloc.Allocations() == 0:
		return s.transition(Closed)
	case !force:
		return fmt.Errorf("slab: close: %w (%d of %d bytes in use in %d allocations)",
			ErrInUse, s.alloc.InUse(), s.alloc.Size(), s.alloc.Allocations())
	case s.state == Closing:
		return nil
	default:
		return s.transition(Closing)
	}
}

// View returns the bytes [off, off+n) of host memory. The range must lie
// inside live allocations, so a view can never reach free space that a
// later allocation would hand to someone else.
func (s *Slab) View(off, n uint64) ([]byte, error) {
	if s.state == Closed {
		return nil, fmt.Errorf("slab: view [%d,+%d): %w", off, n, ErrClosed)
	}
	size := s.alloc.Size()
	if n == 0 || off > size || n > size-off {
		return nil, fmt.Errorf("slab: view [%d,+%d) of %d bytes: %w", off, n, size, ErrOutOfRange)
	}
	if !s.alloc.allocated(off, n) {
		return nil, fmt.Errorf("slab: view [%d,+%d): %w", off, n, ErrNotAllocated)
	}
	return s.mem.Bytes(off, n)
}

// Memory is the described memory; the value is immutable and safe to share.
func (s *Slab) Memory() Memory { return s.mem }

// State is the lifecycle state.
func (s *Slab) State() State { return s.state }

// InUse is the number of bytes in live allocations.
func (s *Slab) InUse() uint64 { return s.alloc.InUse() }

// Size is the number of bytes the slab manages.
func (s *Slab) Size() uint64 { return s.alloc.Size() }

// LargestFree is the largest allocation that would succeed now.
func (s *Slab) LargestFree() uint64 { return s.alloc.LargestFree() }

// Allocations is the number of live allocations.
func (s *Slab) Allocations() int { return s.alloc.Allocations() }

// Len is the rounded length of the allocation that starts at off.
func (s *Slab) Len(off uint64) (uint64, bool) { return s.alloc.Len(off) }
