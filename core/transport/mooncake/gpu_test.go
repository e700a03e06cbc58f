package mooncake

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
)

// hostGPU stands in for a GPU whose memory the engine can read: its
// "device memory" is host memory at real addresses, so that the test
// double (which reads and writes what it is handed) works on it, while
// the writer treats it as device memory throughout. Only the methods the
// writer calls are implemented.
type hostGPU struct {
	gpu.Device // nil: any other method panics, failing the test loudly
	ordinal    int

	mu       sync.Mutex
	mems     [][]byte // every allocation, to resolve addresses
	allocs   int
	copies   int
	failNext error
}

// at is the memory [addr, addr+n) of an allocation.
func (d *hostGPU) at(addr uintptr, n uint64) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range d.mems {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
		if addr >= base && uint64(addr-base)+n <= uint64(len(m)) {
			return m[addr-base : uint64(addr-base)+n]
		}
	}
	panic("hostGPU: no allocation there")
}

func (d *hostGPU) Name() string { return gpu.Name(d.ordinal) }
func (d *hostGPU) Ordinal() int { return d.ordinal }

// devs is the one GPU as gpu.Devices.
type devs struct{ d *hostGPU }

func (s devs) Device(ordinal int) (gpu.Device, error) {
	if ordinal != s.d.ordinal {
		return nil, errors.New("no such device")
	}
	return s.d, nil
}

type hostGPUMem struct{ mem []byte }

func (m *hostGPUMem) Addr() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(m.mem))) }
func (m *hostGPUMem) Len() uint64   { return uint64(len(m.mem)) }
func (m *hostGPUMem) Free() error   { return syscall.Munmap(m.mem) }

func (d *hostGPU) AllocDevice(n uint64) (gpu.DeviceMem, error) {
	mem, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.allocs++
	d.mems = append(d.mems, mem)
	d.mu.Unlock()
	return &hostGPUMem{mem: mem}, nil
}

// readyEvent completes when its channel is closed.
type readyEvent struct{ done chan struct{} }

func (e *readyEvent) Close() error { return nil }

func (d *hostGPU) CopyDevice(ops []gpu.DeviceCopy) error {
	for _, op := range ops {
		if ev, ok := op.After.(*readyEvent); ok {
			<-ev.done
		}
		d.mu.Lock()
		err := d.failNext
		d.failNext = nil
		d.copies++
		d.mu.Unlock()
		if err != nil {
			return err
		}
		copy(d.at(op.Dst, op.N), d.at(op.Src, op.N))
	}
	return nil
}

func (d *hostGPU) counts() (allocs, copies int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.allocs, d.copies
}

// deviceSrc is data in the fake GPU's memory, as an encoder output.
func deviceSrc(t *testing.T, d *hostGPU, data []byte, ready gpu.Event) *transport.DeviceSrc {
	t.Helper()
	m, err := d.AllocDevice(uint64(len(data)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Free() })
	copy(m.(*hostGPUMem).mem, data)
	return &transport.DeviceSrc{Addr: m.Addr(), Len: uint64(len(data)), Ordinal: d.ordinal, Ready: ready}
}

func gpuOn(on bool) func(*Config) { return func(c *Config) { c.GPUMemory = &on } }

func TestDeviceSourcesLeaveFromGPUStaging(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0}
	prod := testConfig(gpuOn(true), func(c *Config) { c.Devices = devs{d} })
	p := newPair(t, 32<<20, testConfig(), prod)
	before := double.Stats()
	sizes := []int{1, 4096, 1<<20 + 3, 5 << 20} // 5 MiB is five chunks, more than staging holds at once
	var items []transport.WriteItem
	var want [][]byte
	at := uint64(0)
	for i, n := range sizes {
		data := pattern(n, byte(i+1))
		it := p.item(i+1, at, nil)
		it.Src, it.Dev = nil, deviceSrc(t, d, data, nil)
		items, want = append(items, it), append(want, data)
		at += uint64(n)
	}
	host := pattern(3<<20, 99)
	items, want = append(items, p.item(9, at, host)), append(want, host)
	for i, err := range write(t, p.w, p.recv.Addr(), items...) {
		require.NoError(t, err, "item %d", i)
	}
	at = 0
	for i, data := range want {
		require.True(t, bytes.Equal(data, p.slab[at:at+uint64(len(data))]), "item %d", i)
		at += uint64(len(data))
	}
	// One GPU staging slab, registered once, beside the host one (the
	// writer registers both on its first write).
	allocs, copies := d.counts()
	require.Equal(t, len(sizes)+1, allocs) // the sources and the staging
	require.Equal(t, 1+1+2+5, copies)      // one copy per chunk
	require.Equal(t, before.RegisterCalls+2, double.Stats().RegisterCalls)

	// A second write reuses the registered staging.
	it := p.item(20, 0, nil)
	it.Src, it.Dev = nil, deviceSrc(t, d, pattern(2<<20, 5), nil)
	require.NoError(t, write(t, p.w, p.recv.Addr(), it)[0])
	require.Equal(t, before.RegisterCalls+2, double.Stats().RegisterCalls)
	require.True(t, bytes.Equal(pattern(2<<20, 5), p.slab[:2<<20]))
	total := uint64(0)
	for _, n := range sizes {
		total += uint64(n)
	}
	require.Equal(t, total+2<<20, p.w.Stats().DeviceBytes)
}

// A producer whose outputs are all on the GPU registers no host staging:
// pinning and registering 256 MiB of host memory it never uses would cost
// the host that memory and the engine its registration.
func TestDeviceOnlyProducerRegistersNoHostStaging(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0}
	p := newPair(t, 8<<20, testConfig(), testConfig(gpuOn(true), func(c *Config) { c.Devices = devs{d} }))
	before := double.Stats()
	it := p.item(1, 0, nil)
	it.Src, it.Dev = nil, deviceSrc(t, d, pattern(1<<20, 7), nil)
	require.NoError(t, write(t, p.w, p.recv.Addr(), it)[0])
	require.True(t, bytes.Equal(pattern(1<<20, 7), p.slab[:1<<20]))
	require.Equal(t, before.RegisterCalls+1, double.Stats().RegisterCalls, "the GPU staging only")

	// A host source later registers the host staging then, once.
	require.NoError(t, write(t, p.w, p.recv.Addr(), p.item(2, 2<<20, pattern(4096, 9)))[0])
	require.NoError(t, write(t, p.w, p.recv.Addr(), p.item(3, 3<<20, pattern(4096, 8)))[0])
	require.Equal(t, before.RegisterCalls+2, double.Stats().RegisterCalls)
	require.True(t, bytes.Equal(pattern(4096, 8), p.slab[3<<20:3<<20+4096]))
}

func TestDeviceSourceReadOnlyAfterItsEvent(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0}
	p := newPair(t, 4<<20, testConfig(), testConfig(gpuOn(true), func(c *Config) { c.Devices = devs{d} }))
	ev := &readyEvent{done: make(chan struct{})}
	data := pattern(2<<20, 3)
	src := deviceSrc(t, d, pattern(2<<20, 0), ev)
	it := p.item(1, 0, nil)
	it.Src, it.Dev = nil, src
	res := make(chan []error, 1)
	go func() { res <- write(t, p.w, p.recv.Addr(), it) }()
	// The encoder finishes writing its output only now; the write must
	// have waited for the event to read it.
	copy(d.at(src.Addr, uint64(len(data))), data)
	close(ev.done)
	require.NoError(t, (<-res)[0])
	require.True(t, bytes.Equal(data, p.slab[:len(data)]))
}

func TestDeviceCopyFailureFailsItsItemOnly(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0, failNext: errors.New("injected copy failure")}
	p := newPair(t, 4<<20, testConfig(), testConfig(gpuOn(true), func(c *Config) { c.Devices = devs{d} }))
	bad := p.item(1, 0, nil)
	bad.Src, bad.Dev = nil, deviceSrc(t, d, pattern(3<<20, 1), nil)
	good := p.item(2, 3<<20, pattern(1<<20, 2))
	errs := write(t, p.w, p.recv.Addr(), bad, good)
	require.ErrorContains(t, errs[0], "injected copy failure")
	require.ErrorContains(t, errs[0], "staging on cuda:0")
	require.NoError(t, errs[1])
	require.True(t, bytes.Equal(pattern(1<<20, 2), p.slab[3<<20:4<<20]))
	require.Zero(t, p.w.Stats().DeviceBytes)
	// Its later chunks were never copied nor sent.
	_, copies := d.counts()
	require.Equal(t, 1, copies)
}

func TestDeviceSourcesNeedAnEngineThatRegistersGPUMemory(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0}
	p := newPair(t, 1<<20, testConfig(), testConfig(gpuOn(false), func(c *Config) { c.Devices = devs{d} }))
	it := p.item(1, 0, nil)
	it.Src, it.Dev = nil, deviceSrc(t, d, pattern(100, 1), nil)
	errs := write(t, p.w, p.recv.Addr(), it)
	require.ErrorIs(t, errs[0], transport.ErrDeviceMemory)
	require.ErrorContains(t, errs[0], "cannot register GPU memory")
	allocs, _ := d.counts()
	require.Equal(t, 1, allocs) // the source only: no staging on the GPU
}

// deviceSink is a slab said to be on a GPU.
type deviceSink struct{ slabSink }

func (s deviceSink) Memory() (uintptr, uint64, string) {
	base, n, _ := s.slabSink.Memory()
	return base, n, "cuda:0"
}

func TestGPUSlabNeedsAnEngineThatRegistersGPUMemory(t *testing.T) {
	needDouble(t)
	tr, err := New(testConfig(gpuOn(false)))
	require.NoError(t, err)
	_, err = tr.Listen("127.0.0.1:0", deviceSink{slabSink{hostSlab(t, 1<<20)}})
	require.ErrorContains(t, err, "slab is on cuda:0")
	require.ErrorContains(t, err, "cannot register GPU memory")

	tr, err = New(testConfig(gpuOn(true)))
	require.NoError(t, err)
	r, err := tr.Listen("127.0.0.1:0", deviceSink{slabSink{hostSlab(t, 1<<20)}})
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

func TestCUDABuildReadFromTheEngine(t *testing.T) {
	needDouble(t) // it links no CUDA runtime
	tr, err := New(testConfig())
	require.NoError(t, err)
	ok, why := tr.RegistersGPU()
	require.False(t, ok, why)
	require.Contains(t, why, "no CUDA build")
	tr, err = New(testConfig(gpuOn(true)))
	require.NoError(t, err)
	ok, _ = tr.RegistersGPU()
	require.True(t, ok, "the setting decides when set")
}

func write(t *testing.T, w transport.Writer, dest string, items ...transport.WriteItem) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	return w.Write(ctx, dest, items)
}

// With an engine that is no CUDA build the producer wraps the transport in
// package staged: device sources reach the writer as page-locked host
// chunks that keep the grant, and land where the item belongs.
func TestNonCUDAEngineTakesDeviceSourcesThroughStaged(t *testing.T) {
	needDouble(t)
	host := gpu.NewFakeHost(1)
	p := newPair(t, 16<<20, testConfig(), testConfig(gpuOn(false)))
	w := staged.New(staged.Config{Inner: p.tr, Devices: host, ChunkBytes: 1 << 20, StagingBytes: 4 << 20, Logger: quiet}).NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	data := pattern(5<<20+7, 4)
	addr, window := host.Alloc(0, len(data))
	copy(window, data)
	it := p.item(1, 1<<20, nil)
	it.Src, it.Dev = nil, &transport.DeviceSrc{Addr: addr, Len: uint64(len(data))}
	host2 := p.item(2, 8<<20, pattern(3000, 5))
	errs := write(t, w, p.recv.Addr(), it, host2)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.True(t, bytes.Equal(data, p.slab[1<<20:1<<20+len(data)]))
	require.True(t, bytes.Equal(pattern(3000, 5), p.slab[8<<20:8<<20+3000]))
	require.NoError(t, w.Close())
	require.Zero(t, host.HostBuffers(), "the page-locked buffers go with the writer")
}

// Concurrent writes of device and host sources share the GPU staging and
// the host staging, each smaller than what is in flight, without waiting
// on each other for ever.
func TestConcurrentDeviceWritesShareGPUStaging(t *testing.T) {
	needDouble(t)
	d := &hostGPU{ordinal: 0}
	small := func(c *Config) { c.StagingBytes, c.ChunkBytes, c.Devices = 2<<20, 512<<10, devs{d} }
	p := newPair(t, 64<<20, testConfig(), testConfig(gpuOn(true), small))
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		dev := pattern(3<<20, byte(g))
		src := deviceSrc(t, d, dev, nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := uint64(g) * (16 << 20)
			it := p.item(1, base, nil)
			it.Src, it.Dev = nil, src
			items := []transport.WriteItem{it, p.item(2, base+(8<<20), pattern(1<<20+3, byte(g+9)))}
			for i, err := range write(t, p.w, p.recv.Addr(), items...) {
				if err != nil {
					t.Errorf("writer %d item %d: %v", g, i, err)
				}
			}
		}()
	}
	wg.Wait()
	for g := 0; g < 4; g++ {
		base := uint64(g) * (16 << 20)
		require.True(t, bytes.Equal(pattern(3<<20, byte(g)), p.slab[base:base+3<<20]), "writer %d, device item", g)
		require.True(t, bytes.Equal(pattern(1<<20+3, byte(g+9)), p.slab[base+8<<20:base+8<<20+1<<20+3]), "writer %d, host item", g)
	}
	require.EqualValues(t, 4*(3<<20), p.w.Stats().DeviceBytes)
}
