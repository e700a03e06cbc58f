package slab

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Split turns one allocation into two that are freed apart, and refuses
// a cut that is unaligned, at an end, outside, or of no allocation.
func TestAllocatorSplit(t *testing.T) {
	a := NewAllocator(16 * Align)
	off, err := a.Alloc(8 * Align)
	require.NoError(t, err)
	for _, bad := range []struct {
		name    string
		off, at uint64
	}{
		{"unaligned", off, off + Align/2},
		{"at the start", off, off},
		{"at the end", off, off + 8*Align},
		{"past the end", off, off + 9*Align},
		{"no allocation", off + Align, off + 2*Align},
	} {
		require.ErrorIs(t, a.Split(bad.off, bad.at), ErrNotAllocated, bad.name)
		require.NoError(t, checkAllocator(a), bad.name)
	}

	require.NoError(t, a.Split(off, off+2*Align))
	require.NoError(t, a.Split(off+2*Align, off+3*Align))
	require.NoError(t, checkAllocator(a))
	require.Equal(t, uint64(8*Align), a.InUse(), "a split moves no byte")
	require.Equal(t, 3, a.Allocations())
	for at, n := range map[uint64]uint64{off: 2 * Align, off + 2*Align: Align, off + 3*Align: 5 * Align} {
		got, ok := a.Len(at)
		require.True(t, ok)
		require.Equal(t, n, got)
	}

	require.NoError(t, a.Free(off+2*Align))
	require.NoError(t, checkAllocator(a))
	require.Equal(t, uint64(7*Align), a.InUse())
	require.NoError(t, a.Free(off))
	require.NoError(t, a.Free(off+3*Align))
	require.NoError(t, checkAllocator(a))
	require.Zero(t, a.InUse())
	require.Equal(t, uint64(16*Align), a.LargestFree(), "the pieces coalesce again")
}
