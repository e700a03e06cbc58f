package slab

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkAllocator verifies the allocator's internal invariants.
func checkAllocator(a *Allocator) error {
	if a.size%Align != 0 {
		return fmt.Errorf("size %d not aligned", a.size)
	}
	var covered, inUse uint64
	for i, e := range a.free {
		if e.len == 0 || e.off%Align != 0 || e.len%Align != 0 || e.end() > a.size {
			return fmt.Errorf("bad free extent %d: %+v", i, e)
		}
		if i > 0 && a.free[i-1].end() >= e.off {
			return fmt.Errorf("free extents %d and %d overlap or touch: %+v %+v", i-1, i, a.free[i-1], e)
		}
		covered += e.len
	}
	for off, n := range a.live {
		if n == 0 || off%Align != 0 || n%Align != 0 || off+n > a.size {
			return fmt.Errorf("bad allocation [%d,+%d)", off, n)
		}
		if !a.allocated(off, n) {
			return fmt.Errorf("allocation [%d,+%d) overlaps free space", off, n)
		}
		inUse += n
	}
	if inUse != a.inUse {
		return fmt.Errorf("InUse %d, live allocations sum to %d", a.inUse, inUse)
	}
	if covered+inUse != a.size {
		return fmt.Errorf("free %d + used %d != size %d", covered, inUse, a.size)
	}
	return nil
}

type allocStep struct {
	free    bool   // free the allocation at arg, else allocate arg bytes
	arg     uint64 // bytes to allocate or offset to free
	wantOff uint64
	wantErr error
}

func TestAllocatorScripts(t *testing.T) {
	const A = Align
	// threeBlocks starts several scripts: three blocks of A from offset 0.
	threeBlocks := []allocStep{{arg: A, wantOff: 0}, {arg: A, wantOff: A}, {arg: A, wantOff: 2 * A}}
	tests := []struct {
		name  string
		size  uint64
		steps []allocStep
	}{
		{"rounds lengths up", 4 * A, []allocStep{
			{arg: 1, wantOff: 0},
			{arg: A, wantOff: A},
			{arg: A + 1, wantOff: 2 * A},
			{arg: 1, wantErr: ErrFull},
		}},
		{"size rounded down", 4*A + A - 1, []allocStep{
			{arg: 4 * A, wantOff: 0},
			{arg: 1, wantErr: ErrFull},
		}},
		{"zero size", 4 * A, []allocStep{{arg: 0, wantErr: ErrZeroSize}}},
		{"first fit reuses the lowest hole", 4 * A, slices.Concat(threeBlocks, []allocStep{
			{free: true, arg: 0},
			{free: true, arg: 2 * A},
			{arg: A, wantOff: 0},
			{arg: 2 * A, wantOff: 2 * A},
		})},
		{"coalesces left", 3 * A, slices.Concat(threeBlocks, []allocStep{
			{free: true, arg: 0},
			{free: true, arg: A},
			{arg: 2 * A, wantOff: 0},
		})},
		{"coalesces right", 3 * A, slices.Concat(threeBlocks, []allocStep{
			{free: true, arg: A},
			{free: true, arg: 0},
			{arg: 2 * A, wantOff: 0},
		})},
		{"coalesces both sides", 3 * A, slices.Concat(threeBlocks, []allocStep{
			{free: true, arg: 0},
			{free: true, arg: 2 * A},
			{arg: 2 * A, wantErr: ErrFull},
			{free: true, arg: A},
			{arg: 3 * A, wantOff: 0},
		})},
		{"double free", 2 * A, []allocStep{
			{arg: A, wantOff: 0},
			{free: true, arg: 0},
			{free: true, arg: 0, wantErr: ErrNotAllocated},
		}},
		{"free of an inner offset", 2 * A, []allocStep{
			{arg: 2 * A, wantOff: 0},
			{free: true, arg: A, wantErr: ErrNotAllocated},
			{free: true, arg: 1, wantErr: ErrNotAllocated},
		}},
		{"request larger than the slab", 2 * A, []allocStep{{arg: 3 * A, wantErr: ErrFull}}},
		{"request near the top of uint64", 2 * A, []allocStep{{arg: math.MaxUint64, wantErr: ErrFull}}},
		{"empty allocator", A - 1, []allocStep{{arg: 1, wantErr: ErrFull}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := NewAllocator(tc.size)
			for i, s := range tc.steps {
				before, beforeN := a.InUse(), a.Allocations()
				var err error
				if s.free {
					err = a.Free(s.arg)
				} else {
					var off uint64
					off, err = a.Alloc(s.arg)
					if s.wantErr == nil {
						require.Equal(t, s.wantOff, off, "step %d", i)
					}
				}
				if s.wantErr != nil {
					require.ErrorIs(t, err, s.wantErr, "step %d", i)
					require.Equal(t, before, a.InUse(), "a refused step changes nothing")
					require.Equal(t, beforeN, a.Allocations())
				} else {
					require.NoError(t, err, "step %d", i)
				}
				require.NoError(t, checkAllocator(a), "step %d", i)
			}
		})
	}
}

func TestAllocatorFullErrorNamesSizes(t *testing.T) {
	a := NewAllocator(4 * Align)
	_, err := a.Alloc(Align)
	require.NoError(t, err)
	_, err = a.Alloc(2 * Align)
	require.NoError(t, err)
	_, err = a.Alloc(1000)
	require.ErrorIs(t, err, ErrFull)
	require.EqualError(t, err, "slab: alloc 1000 bytes: slab full (largest free extent 256 bytes, 768 of 1024 bytes in use)")
}

// TryAlloc tells want of room (ok false, no error) from a request no room
// could serve (an error), and allocates as Alloc does.
func TestTryAllocTellsFullFromInvalid(t *testing.T) {
	a := NewAllocator(4 * Align)
	off, ok, err := a.TryAlloc(3 * Align)
	require.NoError(t, err)
	require.True(t, ok)
	require.Zero(t, off)
	_, ok, err = a.TryAlloc(2 * Align)
	require.NoError(t, err, "a full slab is no error here")
	require.False(t, ok)
	_, ok, err = a.TryAlloc(5 * Align)
	require.NoError(t, err, "more than the slab holds is want of room too, as in Alloc")
	require.False(t, ok)
	_, ok, err = a.TryAlloc(0)
	require.ErrorIs(t, err, ErrZeroSize)
	require.False(t, ok)
	require.Equal(t, uint64(3*Align), a.InUse(), "nothing refused took room")
}

func TestAllocatorAccessors(t *testing.T) {
	a := NewAllocator(8 * Align)
	require.Equal(t, uint64(8*Align), a.Size())
	require.Equal(t, uint64(8*Align), a.LargestFree())
	off, err := a.Alloc(Align + 1)
	require.NoError(t, err)
	n, ok := a.Len(off)
	require.True(t, ok)
	require.Equal(t, uint64(2*Align), n)
	_, ok = a.Len(off + Align)
	require.False(t, ok)
	require.Equal(t, 1, a.Allocations())
	require.Equal(t, uint64(2*Align), a.InUse())
	require.Equal(t, uint64(6*Align), a.LargestFree())
}

// bitmapModel is the obviously-correct allocator: one bit per Align block.
type bitmapModel struct {
	used []bool
	live map[uint64]uint64
}

func newBitmapModel(size uint64) *bitmapModel {
	return &bitmapModel{used: make([]bool, size/Align), live: map[uint64]uint64{}}
}

// firstFit is the lowest offset of a free run of n bytes, if any.
func (m *bitmapModel) firstFit(n uint64) (uint64, bool) {
	blocks := int((n + Align - 1) / Align)
	run := 0
	for i, u := range m.used {
		if u {
			run = 0
			continue
		}
		run++
		if run == blocks {
			return uint64(i+1-blocks) * Align, true
		}
	}
	return 0, false
}

func (m *bitmapModel) mark(off, n uint64, v bool) {
	for b := off / Align; b < (off+n)/Align; b++ {
		m.used[b] = v
	}
}

func (m *bitmapModel) inUse() uint64 {
	var s uint64
	for _, n := range m.live {
		s += n
	}
	return s
}

// modelStep applies one operation to both and checks that they agree.
func modelStep(a *Allocator, m *bitmapModel, doAlloc bool, n, freeOff uint64) error {
	if doAlloc {
		off, err := a.Alloc(n)
		want, fits := m.firstFit(n)
		switch {
		case n == 0:
			if !errors.Is(err, ErrZeroSize) {
				return fmt.Errorf("alloc 0: got %v", err)
			}
		case !fits:
			if !errors.Is(err, ErrFull) {
				return fmt.Errorf("alloc %d: model finds no fit, allocator says (%d, %v)", n, off, err)
			}
		case err != nil:
			return fmt.Errorf("alloc %d: model fits at %d, allocator says %v", n, want, err)
		case off != want:
			return fmt.Errorf("alloc %d: first fit is %d, allocator gave %d", n, want, off)
		default:
			rn := roundUp(n)
			for b := off / Align; b < (off+rn)/Align; b++ {
				if m.used[b] {
					return fmt.Errorf("alloc %d at %d overlaps a live block", n, off)
				}
			}
			m.mark(off, rn, true)
			m.live[off] = rn
		}
	} else {
		err := a.Free(freeOff)
		if n, ok := m.live[freeOff]; ok {
			if err != nil {
				return fmt.Errorf("free %d: %v", freeOff, err)
			}
			m.mark(freeOff, n, false)
			delete(m.live, freeOff)
		} else if !errors.Is(err, ErrNotAllocated) {
			return fmt.Errorf("free of unallocated %d: got %v", freeOff, err)
		}
	}
	if a.InUse() != m.inUse() {
		return fmt.Errorf("InUse %d, model %d", a.InUse(), m.inUse())
	}
	if a.Allocations() != len(m.live) {
		return fmt.Errorf("Allocations %d, model %d", a.Allocations(), len(m.live))
	}
	return checkAllocator(a)
}

// drain frees everything and checks the allocator returns to one extent.
func drain(a *Allocator, m *bitmapModel) error {
	for off := range m.live {
		if err := modelStep(a, m, false, 0, off); err != nil {
			return err
		}
	}
	if a.InUse() != 0 || a.LargestFree() != a.Size() || (a.Size() > 0 && len(a.free) != 1) {
		return fmt.Errorf("after freeing all: in use %d, largest free %d of %d, %d extents",
			a.InUse(), a.LargestFree(), a.Size(), len(a.free))
	}
	return nil
}

func TestAllocatorModel(t *testing.T) {
	const size = 512 * Align
	rng := rand.New(rand.NewPCG(1, 2))
	a, m := NewAllocator(size), newBitmapModel(size)
	var offs []uint64
	for step := range 20000 {
		if rng.IntN(100) < 55 {
			n := uint64(rng.IntN(24*Align)) + 1
			if rng.IntN(50) == 0 {
				n = 0
			}
			require.NoError(t, modelStep(a, m, true, n, 0), "step %d", step)
			offs = offs[:0]
			for off := range m.live {
				offs = append(offs, off)
			}
			continue
		}
		var off uint64
		if len(offs) > 0 && rng.IntN(10) > 0 {
			off = offs[rng.IntN(len(offs))]
		} else {
			off = uint64(rng.IntN(size + Align))
		}
		require.NoError(t, modelStep(a, m, false, 0, off), "step %d", step)
	}
	require.NoError(t, drain(a, m))
}

// FuzzAllocator reads the input as a program: each byte is an operation,
// allocations take their size from the next byte.
func FuzzAllocator(f *testing.F) {
	f.Add([]byte{0x81, 0x10, 0x82, 0x20, 0x00, 0x01, 0x83, 0x05})
	f.Add([]byte{0xff, 0xff, 0x80, 0x00, 0x7f, 0x00, 0x00})
	f.Fuzz(func(t *testing.T, prog []byte) {
		const size = 64 * Align
		a, m := NewAllocator(size), newBitmapModel(size)
		for i := 0; i < len(prog); i++ {
			op := prog[i]
			if op&0x80 != 0 {
				var n uint64
				if i+1 < len(prog) {
					i++
					n = uint64(prog[i]) * uint64(op&0x7f+1)
				}
				if err := modelStep(a, m, true, n, 0); err != nil {
					t.Fatal(err)
				}
				continue
			}
			// Low values free the k-th live allocation in offset order;
			// higher ones aim at arbitrary offsets, mostly not allocated.
			off := uint64(op) * Align / 2
			if op < 32 && len(m.live) > 0 {
				k := int(op) % len(m.live)
				for b := range m.used {
					o := uint64(b) * Align
					if _, ok := m.live[o]; ok {
						if k == 0 {
							off = o
							break
						}
						k--
					}
				}
			}
			if err := modelStep(a, m, false, 0, off); err != nil {
				t.Fatal(err)
			}
		}
		if err := drain(a, m); err != nil {
			t.Fatal(err)
		}
	})
}
