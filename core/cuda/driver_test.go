package cuda

import (
	"bytes"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

func TestLoadFailuresSayWhy(t *testing.T) {
	tests := []struct {
		name, path, want string
	}{
		{"no such library", "/nonexistent/libcuda.so.1", "/nonexistent/libcuda.so.1"},
		{"a library that is not the driver", "libc.so.6", "lacks cuInit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := loadLibrary(tc.path)
			require.ErrorIs(t, err, gpu.ErrUnavailable)
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, "cannot use the CUDA driver")
		})
	}
}

// gpuDevice returns cuda:0, or skips on a machine without a usable driver.
func gpuDevice(t *testing.T) *Device {
	t.Helper()
	drv, err := Default()
	if err != nil {
		require.ErrorIs(t, err, gpu.ErrUnavailable)
		t.Skipf("no GPU here: %v", err)
	}
	dev, err := drv.device(0)
	require.NoError(t, err)
	return dev
}

func TestDefaultWithoutDriverIsUnavailable(t *testing.T) {
	drv, err := Default()
	if err == nil {
		t.Skipf("a CUDA driver is present (version %d, %d devices)", drv.Version(), drv.Count())
	}
	require.ErrorIs(t, err, gpu.ErrUnavailable)
	require.ErrorContains(t, err, DefaultLibrary)
	_, err = gpu.Unavailable{Err: err}.Device(0)
	require.ErrorIs(t, err, gpu.ErrUnavailable)
}

func TestDeviceOutOfRange(t *testing.T) {
	dev := gpuDevice(t)
	drv, _ := Default()
	_, err := drv.Device(drv.Count())
	require.ErrorIs(t, err, gpu.ErrUnavailable)
	again, err := drv.Device(0)
	require.NoError(t, err)
	require.Same(t, dev, again)
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) + seed
	}
	return b
}

func TestCopiesRoundTrip(t *testing.T) {
	dev := gpuDevice(t)
	const n = 3<<20 + 123
	a := devMem(t, dev, 2*n)
	b := devMem(t, dev, n)

	pinned := pinnedMem(t, dev, n)
	want := pattern(n, 3)
	copy(pinned.Bytes(), want)
	// Into the second half of a, from page-locked memory; then a plain Go
	// buffer the other way, which the driver stages.
	require.NoError(t, dev.CopyFromHost(a+n, pinned.Bytes()))
	require.NoError(t, dev.CopyDevice([]gpu.DeviceCopy{{Dst: b, Src: a + n, N: n}}))
	ev, err := dev.RecordEvent(0)
	require.NoError(t, err)
	got := make([]byte, n)
	require.NoError(t, dev.CopyToHost(got, b, ev))
	require.NoError(t, ev.Close())
	require.True(t, bytes.Equal(want, got), "bytes differ after host -> device -> device -> host")
}

func TestCheckAndExport(t *testing.T) {
	dev := gpuDevice(t)
	const n = 4 << 20
	a := devMem(t, dev, n)

	require.NoError(t, gpu.CheckDevice(dev, a+4096, n-4096))
	require.ErrorContains(t, gpu.CheckDevice(dev, a+4096, n), "runs past its allocation")
	pinned := pinnedMem(t, dev, 4096)
	require.Error(t, gpu.CheckDevice(dev, hostAddr(pinned.Bytes()), 4096), "page-locked host memory is not device memory")
	// A batch is checked span by span in one call.
	errs := dev.CheckDevices([]gpu.Span{{Addr: a, N: n}, {Addr: a + 4096, N: n}, {Addr: hostAddr(pinned.Bytes()), N: 4096}, {Addr: a + n - 1, N: 1}})
	require.Len(t, errs, 4)
	require.NoError(t, errs[0])
	require.ErrorContains(t, errs[1], "runs past its allocation")
	require.Error(t, errs[2], "page-locked host memory is not device memory")
	require.NoError(t, errs[3])

	whole, err := dev.ExportIPC(a, n)
	require.NoError(t, err)
	inner, err := dev.ExportIPC(a+1<<20, 1<<20)
	require.NoError(t, err)
	require.Equal(t, uint64(0), whole.Offset)
	require.Equal(t, uint64(1<<20), inner.Offset, "an interior pointer exports its allocation plus an offset")
	require.Equal(t, whole.Handle, inner.Handle)
}

// devMem is n bytes of device memory, freed when t ends.
func devMem(t testing.TB, dev *Device, n int) uintptr {
	t.Helper()
	a, err := dev.memAlloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dev.memFree(a) })
	return a
}

// pinnedMem is n bytes of page-locked host memory, freed when t ends.
func pinnedMem(t testing.TB, dev *Device, n int) gpu.HostMem {
	t.Helper()
	h, err := dev.AllocHost(n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = h.Free() })
	return h
}

// hostAddr is the address of host memory as the driver sees it.
func hostAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// benchCopy reports the bandwidth of one kind of copy of n bytes.
func benchCopy(b *testing.B, n int, copyOnce func(dev *Device, dst, src uintptr, host []byte) error) {
	drv, err := Default()
	if err != nil {
		b.Skipf("no GPU here: %v", err)
	}
	dev, err := drv.device(0)
	require.NoError(b, err)
	src := devMem(b, dev, n)
	dst := devMem(b, dev, n)
	host := pinnedMem(b, dev, n)
	require.NoError(b, copyOnce(dev, dst, src, host.Bytes()))
	b.SetBytes(int64(n))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := copyOnce(dev, dst, src, host.Bytes()); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCopyDevice128MiB(b *testing.B) {
	benchCopy(b, 128<<20, func(dev *Device, dst, src uintptr, _ []byte) error {
		return dev.CopyDevice([]gpu.DeviceCopy{{Dst: dst, Src: src, N: 128 << 20}})
	})
}

func BenchmarkCopyDevice8x4MiB(b *testing.B) {
	benchCopy(b, 32<<20, func(dev *Device, dst, src uintptr, _ []byte) error {
		ops := make([]gpu.DeviceCopy, 8)
		for i := range ops {
			off := uintptr(i) << 22
			ops[i] = gpu.DeviceCopy{Dst: dst + off, Src: src + off, N: 4 << 20}
		}
		return dev.CopyDevice(ops)
	})
}

func BenchmarkCopyToPinnedHost32MiB(b *testing.B) {
	benchCopy(b, 32<<20, func(dev *Device, _, src uintptr, host []byte) error {
		return dev.CopyToHost(host, src, nil)
	})
}

func BenchmarkRecordEventAndCheck(b *testing.B) {
	benchCopy(b, 1<<20, func(dev *Device, dst, _ uintptr, _ []byte) error {
		if err := gpu.CheckDevice(dev, dst, 1<<20); err != nil {
			return err
		}
		ev, err := dev.RecordEvent(0)
		if err != nil {
			return err
		}
		return ev.Close()
	})
}

func TestTimedCopyReportsTheGPUsTime(t *testing.T) {
	dev := gpuDevice(t)
	const n = 64 << 20
	a := devMem(t, dev, n)
	b := devMem(t, dev, n)
	for range 3 {
		tm, err := dev.CopyDeviceTimed([]gpu.DeviceCopy{{Dst: b, Src: a, N: n / 2}, {Dst: b + n/2, Src: a + n/2, N: n / 2}})
		require.NoError(t, err)
		require.Positive(t, tm.GPU, "the driver's timing events measured the copies")
		require.Positive(t, tm.Wait)
		require.Positive(t, tm.QueueCopies, "the copy calls' part of the queueing")
		require.LessOrEqual(t, tm.QueueWaits+tm.QueueCopies, tm.Queue, "the parts lie inside the whole")
		t.Logf("64 MiB in two copies: queue %v (waits %v, copies %v), GPU %v, host wait %v", tm.Queue, tm.QueueWaits, tm.QueueCopies, tm.GPU, tm.Wait)
	}
}

// A transport's own staging slab: device memory it allocates, fills by
// a device copy and frees.
func TestAllocDeviceHoldsWhatIsCopiedIn(t *testing.T) {
	dev := gpuDevice(t)
	const n = 5<<20 + 17
	m, err := dev.AllocDevice(n)
	require.NoError(t, err)
	require.EqualValues(t, n, m.Len())
	require.NoError(t, gpu.CheckDevice(dev, m.Addr(), n))
	src := devMem(t, dev, n)
	want := pattern(n, 9)
	require.NoError(t, dev.CopyFromHost(src, want))
	require.NoError(t, dev.CopyDevice([]gpu.DeviceCopy{{Dst: m.Addr(), Src: src, N: n}}))
	got := make([]byte, n)
	require.NoError(t, dev.CopyToHost(got, m.Addr(), nil))
	require.True(t, bytes.Equal(want, got))
	require.NoError(t, m.Free())
	require.NoError(t, m.Free(), "a second Free is a no-op")
	_, err = dev.AllocDevice(0)
	require.Error(t, err)
}

// The closed events a device keeps are bounded: past the bound, keep
// refuses and the caller destroys the event.
func TestFreeListKeepsAtMostItsBound(t *testing.T) {
	var l freeList[int]
	for i := range 3 {
		require.True(t, l.keep(i, 3), "value %d fits under the bound", i)
	}
	require.False(t, l.keep(3, 3), "a fourth value is past the bound")
	created := 0
	create := func() (int, error) { created++; return 100 + created, nil }
	for want := 2; want >= 0; want-- {
		v, err := l.get(create)
		require.NoError(t, err)
		require.Equal(t, want, v, "kept values come back last in, first out")
	}
	v, err := l.get(create)
	require.NoError(t, err)
	require.Equal(t, 101, v, "an empty list creates")
	require.True(t, l.keep(v, 3), "room again once values were taken")
}

// A closed recorded event is recorded again by the next RecordEvent, not
// created anew; one closed past the bound is destroyed, not kept. A
// second Close of one handle keeps nothing twice.
func TestRecordEventReusesClosedEventsUpToTheBound(t *testing.T) {
	dev := gpuDevice(t)
	first, err := dev.RecordEvent(0)
	require.NoError(t, err)
	h, err := handleOf(first)
	require.NoError(t, err)
	require.NoError(t, first.Close())
	require.NoError(t, first.Close())
	again, err := dev.RecordEvent(0)
	require.NoError(t, err)
	h2, err := handleOf(again)
	require.NoError(t, err)
	require.Equal(t, h, h2, "the closed event is recorded again")
	other, err := dev.RecordEvent(0)
	require.NoError(t, err)
	h3, err := handleOf(other)
	require.NoError(t, err)
	require.NotEqual(t, h2, h3, "an event in use is not handed out twice")
	require.NoError(t, again.Close())
	require.NoError(t, other.Close())

	open := make([]gpu.Event, maxRecorded+4)
	for i := range open {
		open[i], err = dev.RecordEvent(0)
		require.NoError(t, err)
	}
	for _, ev := range open {
		require.NoError(t, ev.Close())
	}
	dev.recorded.mu.Lock()
	kept := len(dev.recorded.free)
	dev.recorded.mu.Unlock()
	require.Equal(t, maxRecorded, kept)
}

// wordRegion is n bytes of shared host memory registered with dev, as a
// shard's ready-word region is; the test is skipped on a driver that
// cannot store words there. Both are undone at the test's end.
func wordRegion(t testing.TB, dev *Device, n int) ([]byte, gpu.HostRegistration) {
	mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Munmap(mem) })
	reg, err := dev.RegisterHost(mem)
	if err != nil {
		t.Skipf("no ready words on this driver: %v", err)
	}
	t.Cleanup(func() { require.NoError(t, reg.Close()) })
	return mem, reg
}

// TestReadyWordFollowsTheCopy: a word stored from the copy stream into
// registered host memory (a shared mapping, as a shard's ready-word
// region is) holds its value once the batch returns, and the bytes of the
// copy before it are in place.
func TestReadyWordFollowsTheCopy(t *testing.T) {
	dev := gpuDevice(t)
	mem, reg := wordRegion(t, dev, 4096)
	src, err := dev.memAlloc(1 << 20)
	require.NoError(t, err)
	defer dev.memFree(src)
	dst, err := dev.memAlloc(1 << 20)
	require.NoError(t, err)
	defer dev.memFree(dst)
	want := bytes.Repeat([]byte{0x5a}, 1<<20)
	require.NoError(t, dev.CopyFromHost(src, want))
	_, err = dev.CopyDeviceThen([]gpu.DeviceCopy{{Dst: dst, Src: src, N: 1 << 20}}, []gpu.ValueWrite{{Addr: reg.DevAddr() + 64, Value: 0x1_0000_0007}})
	require.NoError(t, err)
	require.Equal(t, uint64(0x1_0000_0007), atomic.LoadUint64((*uint64)(unsafe.Pointer(&mem[64]))))
	got := make([]byte, 1<<20)
	require.NoError(t, dev.CopyToHost(got, dst, nil))
	require.Equal(t, want, got)
}

// TestBatchPastTheDriversChunks: a batch of more copies than one
// cuMemcpyBatchAsync call takes (with an empty one among them) and more
// words than one cuStreamBatchMemOp call takes lands every byte and every
// word.
func TestBatchPastTheDriversChunks(t *testing.T) {
	dev := gpuDevice(t)
	const copies, words, item = 70, 300, 4096
	mem, reg := wordRegion(t, dev, 8*words)
	src, err := dev.memAlloc(copies * item)
	require.NoError(t, err)
	defer dev.memFree(src)
	dst, err := dev.memAlloc(copies * item)
	require.NoError(t, err)
	defer dev.memFree(dst)
	want := make([]byte, copies*item)
	for i := range want {
		want[i] = byte(i*7 + i/item)
	}
	require.NoError(t, dev.CopyFromHost(src, want))
	require.NoError(t, dev.CopyFromHost(dst, make([]byte, copies*item)))
	var ops []gpu.DeviceCopy
	for i := range copies {
		off := uintptr(i * item)
		n := uint64(item)
		if i == 5 {
			n = 0 // left as zeros
		}
		ops = append(ops, gpu.DeviceCopy{Dst: dst + off, Src: src + off, N: n})
	}
	then := make([]gpu.ValueWrite, words)
	for i := range then {
		then[i] = gpu.ValueWrite{Addr: reg.DevAddr() + uintptr(8*i), Value: uint64(i)<<32 | 0x5a}
	}
	_, err = dev.CopyDeviceThen(ops, then)
	require.NoError(t, err)
	for i := range words {
		require.Equal(t, uint64(i)<<32|0x5a, atomic.LoadUint64((*uint64)(unsafe.Pointer(&mem[8*i]))), "word %d", i)
	}
	got := make([]byte, copies*item)
	require.NoError(t, dev.CopyToHost(got, dst, nil))
	clear(want[5*item : 6*item])
	require.Equal(t, want, got)
}

// The cost of ready words on the copy path: 8 × 32 MiB timed, with and
// without a word stored after the copies for each item (b.ReportMetric
// gives the host's time to queue the batch, the GPU's time and the host's
// wait per batch).
func BenchmarkCopy8x32MiBTimed(b *testing.B) { benchWords(b, wordsBench{}) }

func BenchmarkCopy8x32MiBThenWords(b *testing.B) { benchWords(b, wordsBench{words: true}) }

// What the product's batches have and the ones above do not, one at a
// time, to tell which one its copy_queue phase pays for: the stream
// waiting on the sources' event (recorded on another stream, as the
// encoder's), and the next batch queued while the one before still runs.
func BenchmarkCopy8x32MiBAfterEventThenWords(b *testing.B) {
	benchWords(b, wordsBench{words: true, after: true})
}

func BenchmarkCopy8x32MiBInFlightThenWords(b *testing.B) {
	benchWords(b, wordsBench{words: true, after: true, inFlight: true})
}

// The product queues a batch on a thread that slept (the encoder's, or
// one woken by a reply), not in a loop that keeps the driver's and the
// CPU's caches warm: here each batch is queued 2 ms after the last ended.
func BenchmarkCopy8x32MiBAfterIdleThenWords(b *testing.B) {
	benchWords(b, wordsBench{words: true, after: true, idle: 2 * time.Millisecond})
}

type wordsBench struct {
	words, after, inFlight bool
	idle                   time.Duration
}

func benchWords(b *testing.B, mode wordsBench) {
	const item, n = 32 << 20, 8
	var then []gpu.ValueWrite
	var gpuNS, waitNS, queueNS, waitsNS, copiesNS time.Duration
	var prev gpu.Pending
	waitFor := func(p gpu.Pending) error {
		tm, err := p.Wait()
		gpuNS += tm.GPU
		waitNS += tm.Wait
		queueNS += tm.Queue
		waitsNS += tm.QueueWaits
		copiesNS += tm.QueueCopies
		return err
	}
	benchCopy(b, item*n, func(dev *Device, dst, src uintptr, _ []byte) error {
		if mode.words && then == nil {
			_, reg := wordRegion(b, dev, 4096)
			for i := range n {
				then = append(then, gpu.ValueWrite{Addr: reg.DevAddr() + uintptr(8*i), Value: uint64(i + 1)})
			}
		}
		time.Sleep(mode.idle)
		var after gpu.Event
		if mode.after {
			ev, err := dev.RecordEvent(0)
			if err != nil {
				return err
			}
			defer ev.Close()
			after = ev
		}
		ops := make([]gpu.DeviceCopy, n)
		for i := range ops {
			off := uintptr(i) * item
			ops[i] = gpu.DeviceCopy{Dst: dst + off, Src: src + off, N: item, After: after}
		}
		p, err := dev.QueueCopyThen(ops, then)
		if err != nil {
			return err
		}
		if !mode.inFlight {
			return waitFor(p)
		}
		// This batch was queued behind the one before, still running.
		if prev != nil {
			err = waitFor(prev)
		}
		prev = p
		return err
	})
	if prev != nil {
		require.NoError(b, waitFor(prev))
	}
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(b.N+1) }
	b.ReportMetric(per(queueNS), "queue-us/op")
	b.ReportMetric(per(waitsNS), "queue-waits-us/op")
	b.ReportMetric(per(copiesNS), "queue-copies-us/op")
	b.ReportMetric(per(gpuNS), "gpu-us/op")
	b.ReportMetric(per(waitNS), "wait-us/op")
}

// A batch of device-to-host copies lands every op in its own buffer
// (page-locked and Go memory alike), and an op that cannot be queued (a
// source that is no device memory) fails alone: the ops on either side of
// it still land.
func TestHostCopyBatchFailsOnlyTheBadOp(t *testing.T) {
	dev := gpuDevice(t)
	const n, ops = 64<<10 + 5, 6
	src := devMem(t, dev, n*ops)
	pinned := pinnedMem(t, dev, n*ops)
	want := pattern(n*ops, 11)
	copy(pinned.Bytes(), want)
	require.NoError(t, dev.CopyFromHost(src, pinned.Bytes()))
	clear(pinned.Bytes())
	ev, err := dev.RecordEvent(0)
	require.NoError(t, err)
	defer ev.Close()

	batch := make([]gpu.HostCopy, ops)
	for i := range batch {
		dst := pinned.Bytes()[i*n : (i+1)*n]
		if i%2 == 1 {
			dst = make([]byte, n)
		}
		batch[i] = gpu.HostCopy{Dst: dst, Src: src + uintptr(i*n), After: ev}
	}
	const bad = 3
	batch[bad].Src = 0x10 // no device memory
	errs := dev.CopyToHostBatch(batch)
	for i, op := range batch {
		if i == bad {
			require.Error(t, errs[i], "op %d reads from no device memory", i)
			require.ErrorContains(t, errs[i], "bytes to host from 0x10")
			continue
		}
		require.NoError(t, errs[i], "op %d", i)
		require.True(t, bytes.Equal(want[i*n:(i+1)*n], op.Dst), "op %d's bytes differ", i)
	}
	// The device is still usable after the failed op.
	got := make([]byte, n)
	require.NoError(t, dev.CopyToHost(got, src, nil))
	require.Equal(t, want[:n], got)
}
