package slab

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

func TestMemoryBytes(t *testing.T) {
	buf := make([]byte, 1000)
	for i := range buf {
		buf[i] = byte(i)
	}
	host := HostMemory(buf)
	require.Equal(t, uint64(1000), host.Len)
	require.Equal(t, DeviceCPU, host.Device)
	require.NotZero(t, host.Addr)
	require.True(t, host.IsHost())

	dev := DeviceMemory(0x7f0000000000, 1<<20, "cuda:1")
	require.False(t, dev.IsHost())

	tests := []struct {
		name    string
		m       Memory
		off, n  uint64
		wantErr error
	}{
		{"whole", host, 0, 1000, nil},
		{"inner", host, 10, 20, nil},
		{"empty at end", host, 1000, 0, nil},
		{"past end", host, 990, 11, ErrOutOfRange},
		{"offset past end", host, 1001, 0, ErrOutOfRange},
		{"length overflows", host, 10, math.MaxUint64, ErrOutOfRange},
		{"offset overflows", host, math.MaxUint64, 2, ErrOutOfRange},
		{"device memory", dev, 0, 1, ErrNotHost},
		{"zero memory", Memory{}, 0, 0, ErrNotHost},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := tc.m.Bytes(tc.off, tc.n)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				require.Nil(t, b)
				return
			}
			require.NoError(t, err)
			require.Len(t, b, int(tc.n))
			require.Equal(t, len(b), cap(b), "a view must not reach past its end through append")
			if tc.n > 0 {
				require.Equal(t, byte(tc.off), b[0])
			}
		})
	}

	empty := HostMemory(nil)
	require.True(t, empty.IsHost())
	b, err := empty.Bytes(0, 0)
	require.NoError(t, err)
	require.Empty(t, b)
}

func TestSlabTransitions(t *testing.T) {
	const legalEdges = `
		open    -> closing closed
		closing -> closed
	`
	fsmtest.CheckAll(t, fsmtest.Machine[State]{
		N: numStates, Legal: legalEdges, Illegal: ErrBadTransition,
		Terminal: func(s State) bool { return s == Closed },
		Transition: func(from, to State) error {
			s := &Slab{alloc: NewAllocator(0), state: from}
			err := s.transition(to)
			if err == nil {
				require.Equal(t, to, s.State(), "%s -> %s", from, to)
			} else {
				require.Equal(t, from, s.State(), "%s -> %s: a refused move leaves the state alone", from, to)
			}
			return err
		},
	})
	require.Equal(t, "State(9)", State(9).String())
}

// slabStep is one call in a lifecycle script. Allocations are named by
// their index in the order they were made.
type slabStep struct {
	op        string // "alloc", "free", "close", "force"
	arg       uint64 // bytes for alloc, allocation index for free
	wantErr   error
	wantState State
}

func TestSlabLifecycle(t *testing.T) {
	tests := []struct {
		name  string
		steps []slabStep
	}{
		{"close empty", []slabStep{
			{op: "close", wantState: Closed},
			{op: "alloc", arg: 1, wantErr: ErrClosed, wantState: Closed},
			{op: "close", wantState: Closed},
			{op: "force", wantState: Closed},
		}},
		{"close refused while in use", []slabStep{
			{op: "alloc", arg: 10, wantState: Open},
			{op: "close", wantErr: ErrInUse, wantState: Open},
			{op: "alloc", arg: 10, wantState: Open},
			{op: "free", arg: 0, wantState: Open},
			{op: "free", arg: 1, wantState: Open},
			{op: "close", wantState: Closed},
		}},
		{"forced close drains", []slabStep{
			{op: "alloc", arg: 10, wantState: Open},
			{op: "alloc", arg: 10, wantState: Open},
			{op: "force", wantState: Closing},
			{op: "alloc", arg: 1, wantErr: ErrClosed, wantState: Closing},
			{op: "close", wantErr: ErrInUse, wantState: Closing},
			{op: "force", wantState: Closing},
			{op: "free", arg: 0, wantState: Closing},
			{op: "free", arg: 0, wantErr: ErrNotAllocated, wantState: Closing},
			{op: "free", arg: 1, wantState: Closed},
			{op: "free", arg: 1, wantErr: ErrClosed, wantState: Closed},
		}},
		{"forced close of an empty slab", []slabStep{
			{op: "force", wantState: Closed},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSlab(HostMemory(make([]byte, 16*Align)))
			var offs []uint64
			for i, st := range tc.steps {
				var err error
				switch st.op {
				case "alloc":
					var off uint64
					off, err = s.Alloc(st.arg)
					if err == nil {
						offs = append(offs, off)
					}
				case "free":
					err = s.Free(offs[st.arg])
				case "close":
					err = s.Close(false)
				case "force":
					err = s.Close(true)
				default:
					t.Fatalf("unknown op %q", st.op)
				}
				if st.wantErr != nil {
					require.ErrorIs(t, err, st.wantErr, "step %d", i)
				} else {
					require.NoError(t, err, "step %d", i)
				}
				require.Equal(t, st.wantState, s.State(), "step %d", i)
				require.NoError(t, checkAllocator(s.alloc), "step %d", i)
			}
		})
	}
}

func TestSlabCloseErrorNamesBytes(t *testing.T) {
	s := NewSlab(HostMemory(make([]byte, 4*Align)))
	_, err := s.Alloc(300)
	require.NoError(t, err)
	require.EqualError(t, s.Close(false), "slab: close: slab in use (512 of 1024 bytes in use in 1 allocations)")
}

func TestSlabView(t *testing.T) {
	buf := make([]byte, 8*Align)
	s := NewSlab(HostMemory(buf))
	a, err := s.Alloc(2 * Align)
	require.NoError(t, err)
	b, err := s.Alloc(Align)
	require.NoError(t, err)
	require.Equal(t, uint64(2*Align), b)

	tests := []struct {
		name    string
		off, n  uint64
		wantErr error
	}{
		{"one region", a, 2 * Align, nil},
		{"inside a region", a + 5, 7, nil},
		{"across two live regions", a + Align, 2 * Align, nil},
		{"into free space", b, Align + 1, ErrNotAllocated},
		{"free space", 4 * Align, 1, ErrNotAllocated},
		{"empty", a, 0, ErrOutOfRange},
		{"past the end", 8*Align - 1, 2, ErrOutOfRange},
		{"overflowing", a + 1, math.MaxUint64, ErrOutOfRange},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v, err := s.View(tc.off, tc.n)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Len(t, v, int(tc.n))
			v[0] = 0xAB
			require.Equal(t, byte(0xAB), buf[tc.off], "a view aliases the caller's memory")
		})
	}

	dev := NewSlab(DeviceMemory(0x1000, 4*Align, "cuda:0"))
	off, err := dev.Alloc(1)
	require.NoError(t, err)
	_, err = dev.View(off, 1)
	require.ErrorIs(t, err, ErrNotHost)

	require.NoError(t, s.Close(true))
	require.NoError(t, s.Free(a))
	require.NoError(t, s.Free(b))
	require.Equal(t, Closed, s.State())
	_, err = s.View(a, 1)
	require.ErrorIs(t, err, ErrClosed)
}

func TestSlabAccessors(t *testing.T) {
	m := HostMemory(make([]byte, 4*Align+7))
	s := NewSlab(m)
	require.Equal(t, uint64(4*Align), s.Size())
	require.Equal(t, m.Addr, s.Memory().Addr)
	off, err := s.Alloc(Align + 1)
	require.NoError(t, err)
	require.Equal(t, uint64(2*Align), s.InUse())
	require.Equal(t, uint64(2*Align), s.LargestFree())
	require.Equal(t, 1, s.Allocations())
	n, ok := s.Len(off)
	require.True(t, ok)
	require.Equal(t, uint64(2*Align), n)
	require.Equal(t, "open", Open.String())
	require.Equal(t, "closing", Closing.String())
	require.Equal(t, "closed", Closed.String())
}
