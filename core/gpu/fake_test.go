package gpu

import (
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

func TestFakeCopiesCheckBothEnds(t *testing.T) {
	h := NewFakeHost(2)
	d0, err := h.Device(0)
	require.NoError(t, err)
	_, err = h.Device(2)
	require.ErrorIs(t, err, ErrUnavailable)

	a, aw := h.Alloc(0, 100)
	b, bw := h.Alloc(1, 100)
	copy(aw, "hello")
	require.NoError(t, d0.CopyDevice([]DeviceCopy{{Dst: b + 10, Src: a, N: 5}}))
	require.Equal(t, []byte("hello"), bw[10:15])
	require.ErrorContains(t, d0.CopyDevice([]DeviceCopy{{Dst: b + 96, Src: a, N: 5}}), "runs past its allocation")
	require.ErrorContains(t, d0.CopyFromHost(b+200, []byte("x")), "no live allocation")
	got := make([]byte, 5)
	require.NoError(t, d0.CopyToHost(got, b+10, nil))
	require.Equal(t, []byte("hello"), got)

	require.NoError(t, CheckDevice(d0, a, 100))
	require.ErrorContains(t, CheckDevice(d0, b, 100), "memory of cuda:1")
	require.Error(t, CheckDevice(d0, a, 101))
	errs := d0.CheckDevices([]Span{{Addr: a, N: 100}, {Addr: b, N: 100}, {Addr: a + 50, N: 51}, {Addr: a + 99, N: 1}})
	require.Len(t, errs, 4)
	require.NoError(t, errs[0])
	require.ErrorContains(t, errs[1], "memory of cuda:1")
	require.ErrorContains(t, errs[2], "runs past its allocation")
	require.NoError(t, errs[3])
}

func TestFakeIPC(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	a, aw := h.Alloc(0, 4096)
	exp, err := d.ExportIPC(a+1024, 1024)
	require.NoError(t, err)
	require.Equal(t, uint64(1024), exp.Offset)
	again, err := d.ExportIPC(a, 4096)
	require.NoError(t, err)
	require.Equal(t, exp.Handle, again.Handle, "one handle per allocation")

	m, err := d.OpenIPC(exp.Handle)
	require.NoError(t, err)
	require.NotEqual(t, a, m.Addr(), "a mapping has its own address")
	require.NoError(t, d.CopyFromHost(m.Addr()+uintptr(exp.Offset), []byte("via ipc")))
	require.Equal(t, []byte("via ipc"), aw[1024:1031])
	require.Equal(t, 1, h.OpenMappings())
	require.NoError(t, m.Close())
	require.Error(t, m.Close())
	require.Zero(t, h.OpenMappings())
	require.Error(t, d.CopyFromHost(m.Addr(), []byte("x")), "a closed mapping takes no copies")

	require.NoError(t, h.Free(a))
	_, err = d.OpenIPC(exp.Handle)
	require.ErrorContains(t, err, "invalid handle")
}

func TestFakeEventsOrderCopies(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	a, aw := h.Alloc(0, 4)
	s := h.NewStream()
	s.Hold()
	ev, err := d.RecordEvent(s.Handle())
	require.NoError(t, err)
	got := make(chan []byte)
	go func() {
		b := make([]byte, 4)
		_ = d.CopyToHost(b, a, ev)
		got <- b
	}()
	copy(aw, "done")
	s.Release()
	require.Equal(t, []byte("done"), <-got)
	require.Equal(t, 1, h.OpenEvents())
	require.NoError(t, ev.Close())
	require.Zero(t, h.OpenEvents())
	require.Equal(t, 1, h.RecordedEvents(), "a closed event was still recorded")
	_, err = d.RecordEvent(12345)
	require.ErrorContains(t, err, "unknown stream")
}

func TestFakeHostMemoryAndInjectedFailures(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	m, err := d.AllocHost(10)
	require.NoError(t, err)
	require.Len(t, m.Bytes(), 10)
	require.Equal(t, 1, h.HostBuffers())
	require.NoError(t, m.Free())
	require.Error(t, m.Free())
	require.Zero(t, h.HostBuffers())

	a, _ := h.Alloc(0, 10)
	h.FailNextCopies(ErrUnavailable)
	require.ErrorIs(t, d.CopyFromHost(a, []byte("x")), ErrUnavailable)
	require.NoError(t, d.CopyFromHost(a, []byte("x")))
	require.Equal(t, 2, h.Copies())
}

func TestShareClosesTheEventWithTheLastHandle(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	ev, err := d.RecordEvent(0)
	require.NoError(t, err)
	handles := Share(ev, 3)
	require.Len(t, handles, 3)
	for i, hd := range handles {
		require.Same(t, ev, Base(hd))
		require.NoError(t, hd.Close())
		require.NoError(t, hd.Close(), "a handle closes once")
		if i < 2 {
			require.Equal(t, 1, h.OpenEvents(), "the event outlives all but the last handle")
		}
	}
	require.Zero(t, h.OpenEvents())
	require.Equal(t, []Event{ev}, Share(ev, 1))
	require.Same(t, ev, Base(ev))
}

func TestFakeTimedCopiesReportTheirParts(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	tc, ok := d.(TimedCopier)
	require.True(t, ok, "the fake reports where a copy's time went, as the CUDA device does")
	a, aw := h.Alloc(0, 64)
	b, bw := h.Alloc(0, 64)
	copy(aw, "timed")
	tm, err := tc.CopyDeviceTimed([]DeviceCopy{{Dst: b, Src: a, N: 5}})
	require.NoError(t, err)
	require.Equal(t, []byte("timed"), bw[:5])
	require.GreaterOrEqual(t, tm.Wait, tm.GPU, "the host cannot see a copy end before the GPU ended it")
	require.GreaterOrEqual(t, tm.GPU, time.Duration(0))
	h.FailNextCopies(errors.New("boom"))
	_, err = tc.CopyDeviceTimed([]DeviceCopy{{Dst: b, Src: a, N: 5}})
	require.ErrorContains(t, err, "boom")
}

// TestFakeValueWritesFollowTheCopies: the words land after the copies, in
// the registered memory; a skipped word leaves the memory as it was; an
// unregistered address is refused; a refused registration says why.
func TestFakeValueWritesFollowTheCopies(t *testing.T) {
	h := NewFakeHost(1)
	d, _ := h.Device(0)
	vw := d.(ValueWriter)
	a, aw := h.Alloc(0, 64)
	b, bw := h.Alloc(0, 64)
	copy(aw, "bytes")
	words := make([]uint64, 4)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), 32)
	reg, err := vw.RegisterHost(mem)
	require.NoError(t, err)
	_, err = CopyThen(vw, []DeviceCopy{{Dst: b, Src: a, N: 5}}, []ValueWrite{{Addr: reg.DevAddr() + 8, Value: 7}, {Addr: reg.DevAddr() + 16, Value: 9}})
	require.NoError(t, err)
	require.Equal(t, []byte("bytes"), bw[:5])
	require.Equal(t, []uint64{0, 7, 9, 0}, words)

	h.SkipNextValueWrites(1)
	_, err = CopyThen(vw, nil, []ValueWrite{{Addr: reg.DevAddr(), Value: 1}, {Addr: reg.DevAddr() + 24, Value: 2}})
	require.NoError(t, err)
	require.Equal(t, []uint64{0, 7, 9, 2}, words, "the first word was skipped")
	require.Equal(t, 3, h.WordsStored())

	require.NoError(t, reg.Close())
	_, err = CopyThen(vw, nil, []ValueWrite{{Addr: reg.DevAddr(), Value: 1}})
	require.ErrorContains(t, err, "no live allocation", "an unregistered address is refused")

	h.RefuseHostRegister(errors.New("no stream memory operations"))
	_, err = vw.RegisterHost(mem)
	require.ErrorContains(t, err, "no stream memory operations")
}
