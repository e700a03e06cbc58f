package staged

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

const chunk = 64 << 10

// side is one end of a staged pair over loopback TCP.
type consumerSide struct {
	regions *transporttest.Regions
	window  []byte // the device slab's bytes; nil for a host slab
	recv    transport.Receiver
}

// slabBytes returns the bytes of a region wherever the slab lives.
func (c *consumerSide) slabBytes(res ids.ResID, n int) []byte {
	off := c.regions.Offset(res)
	if c.window != nil {
		return c.window[off : off+uint64(n)]
	}
	return c.regions.Host()[off : off+uint64(n)]
}

func listen(t *testing.T, host *gpu.FakeHost, device bool, staging int) *consumerSide {
	t.Helper()
	const size = 8 << 20
	cfg := Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), StagingBytes: staging, Logger: transporttest.Quiet()}
	c := &consumerSide{}
	if device {
		dev, err := host.Device(0)
		require.NoError(t, err)
		addr, window := host.Alloc(0, size)
		cfg.Slab, cfg.SlabDevice = slab.DeviceMemory(addr, size, dev.Name()), dev
		c.regions, c.window = transporttest.NewDevice(size), window
	} else {
		c.regions = transporttest.NewHost(size)
	}
	r, err := New(cfg).Listen("127.0.0.1:0", c.regions)
	require.NoError(t, err)
	c.recv = r
	t.Cleanup(func() { _ = r.Close() })
	return c
}

func newWriter(t *testing.T, host *gpu.FakeHost, staging int) transport.Writer {
	t.Helper()
	tr := New(Config{
		Inner:   tcp.NewTCP(tcp.TCPConfig{Conns: 3, ChunkSize: chunk, Logger: transporttest.Quiet()}),
		Devices: host, ChunkBytes: chunk, StagingBytes: staging, Logger: transporttest.Quiet(),
	})
	w := tr.NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func write(t *testing.T, w transport.Writer, dest string, items ...transport.WriteItem) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return w.Write(ctx, dest, items)
}

func TestStagedRoundTrips(t *testing.T) {
	sizes := []int{1, 1000, 3*chunk + 17, chunk, 2 * chunk}
	cases := []struct {
		name               string
		deviceSrc, devSlab bool
	}{
		{"device sources into a host slab", true, false},
		{"host sources into a device slab", false, true},
		{"device sources into a device slab", true, true},
		{"host to host passes straight through", false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			host := gpu.NewFakeHost(1)
			c := listen(t, host, tc.devSlab, 4*chunk)
			w := newWriter(t, host, 3*chunk)
			var items []transport.WriteItem
			var want [][]byte
			for i, n := range sizes {
				res, tok := c.regions.Reserve(uint64(n))
				data := transporttest.RandBytes(uint64(i), n)
				it := transport.WriteItem{Res: res, Token: tok}
				if tc.deviceSrc {
					addr, window := host.Alloc(0, n)
					copy(window, data)
					it.Dev = &transport.DeviceSrc{Addr: addr, Len: uint64(n)}
				} else {
					it.Src = data
				}
				items = append(items, it)
				want = append(want, data)
			}
			for i, err := range write(t, w, c.recv.Addr(), items...) {
				require.NoError(t, err, "item %d", i)
			}
			for i, it := range items {
				require.True(t, bytes.Equal(want[i], c.slabBytes(it.Res, sizes[i])), "item %d (%d bytes) differs", i, sizes[i])
				require.False(t, c.regions.Torn(it.Res))
			}
			require.NoError(t, c.regions.Balance())
			if tc.deviceSrc {
				require.Greater(t, c.regions.Frames(), len(sizes), "large device items travel as several frames")
			}
			require.NoError(t, w.Close())
			require.NoError(t, c.recv.Close())
			require.Zero(t, host.HostBuffers(), "every page-locked buffer is freed once both ends are closed")
		})
	}
}

func TestSourceIsReadOnlyAfterItsEvent(t *testing.T) {
	host := gpu.NewFakeHost(1)
	c := listen(t, host, true, 4*chunk)
	w := newWriter(t, host, 2*chunk)
	dev, err := host.Device(0)
	require.NoError(t, err)

	const n = 3*chunk + 5
	addr, window := host.Alloc(0, n)
	stream := host.NewStream()
	// A long kernel is still writing the source when it is handed over.
	stream.Hold()
	ready, err := dev.RecordEvent(stream.Handle())
	require.NoError(t, err)
	res, tok := c.regions.Reserve(n)
	done := make(chan []error, 1)
	go func() {
		done <- write(t, w, c.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Dev: &transport.DeviceSrc{Addr: addr, Len: n, Ready: ready}})
	}()
	final := transporttest.RandBytes(9, n)
	copy(window, final)
	stream.Release()
	errs := <-done
	require.NoError(t, errs[0])
	require.True(t, bytes.Equal(final, c.slabBytes(res, n)), "the bytes sent are the ones the kernel finished writing")
	require.NoError(t, ready.Close())
}

func TestReceiveCopyFailureRefusesTheFrame(t *testing.T) {
	host := gpu.NewFakeHost(1)
	c := listen(t, host, true, 4*chunk)
	w := newWriter(t, host, 2*chunk)
	res, tok := c.regions.Reserve(100)
	host.FailNextCopies(errors.New("injected copy failure"))
	errs := write(t, w, c.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Src: transporttest.RandBytes(1, 100)})
	require.ErrorIs(t, errs[0], transport.ErrRejected)
	require.ErrorContains(t, errs[0], "injected copy failure")
	require.True(t, c.regions.Torn(res), "the shard hears the frame ended without its bytes")
	require.NoError(t, c.regions.Balance())
}

func TestSendCopyFailureFailsTheItemOnly(t *testing.T) {
	host := gpu.NewFakeHost(1)
	c := listen(t, host, false, 0)
	w := newWriter(t, host, 2*chunk)
	bad, badTok := c.regions.Reserve(10)
	good, goodTok := c.regions.Reserve(10)
	addr, window := host.Alloc(0, 10)
	copy(window, "0123456789")
	host.FailNextCopies(errors.New("injected copy failure"))
	errs := write(t, w, c.recv.Addr(),
		transport.WriteItem{Res: bad, Token: badTok, Dev: &transport.DeviceSrc{Addr: addr, Len: 10}},
		transport.WriteItem{Res: good, Token: goodTok, Dev: &transport.DeviceSrc{Addr: addr, Len: 10}},
	)
	require.ErrorContains(t, errs[0], "injected copy failure")
	require.NoError(t, errs[1])
	require.Equal(t, []byte("0123456789"), c.slabBytes(good, 10))
}

func TestDeviceSourceOnAMissingDevice(t *testing.T) {
	host := gpu.NewFakeHost(1)
	c := listen(t, host, false, 0)
	w := newWriter(t, host, 2*chunk)
	res, tok := c.regions.Reserve(10)
	errs := write(t, w, c.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Dev: &transport.DeviceSrc{Addr: 1, Len: 10, Ordinal: 3}})
	require.ErrorIs(t, errs[0], gpu.ErrUnavailable)
	require.ErrorContains(t, errs[0], "cuda:3")
}

func TestListenOverDeviceSlabNeedsRegionSink(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	addr, _ := host.Alloc(0, 1<<20)
	tr := New(Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Slab: slab.DeviceMemory(addr, 1<<20, "cuda:0"), SlabDevice: dev})
	_, err := tr.Listen("127.0.0.1:0", plainSink{})
	require.ErrorContains(t, err, "no RegionSink")
}

type plainSink struct{}

func (plainSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) { return nil, nil }
func (plainSink) EndWrite(ids.ResID, bool)                                        {}

// TestSpentBudgetStagesThroughPageableMemory drives the sink directly: a
// frame that finds every buffer lent still lands, through pageable memory.
func TestSpentBudgetStagesThroughPageableMemory(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	const size = 4 << 20
	addr, window := host.Alloc(0, size)
	regions := transporttest.NewDevice(size)
	s := &stagingSink{inner: regions, dev: dev, slab: slab.DeviceMemory(addr, size, "cuda:0"), pool: newPool(1, receiveRound), log: transporttest.Quiet()}
	res, tok := regions.Reserve(2000)

	first, err := s.BeginFrame(res, tok, 0, 1000)
	require.NoError(t, err)
	second, err := s.BeginFrame(res, tok, 1000, 1000)
	require.NoError(t, err)
	require.NotNil(t, first.(*stagedFrame).host, "the first frame gets the one page-locked buffer the budget allows")
	require.Nil(t, second.(*stagedFrame).host, "the second stages through pageable memory instead of waiting")
	want := transporttest.RandBytes(3, 2000)
	copy(first.Bytes(), want[:1000])
	copy(second.Bytes(), want[1000:])
	require.NoError(t, second.End(true))
	require.NoError(t, first.End(true))
	off := regions.Offset(res)
	require.Equal(t, want, window[off:off+2000])
	require.Equal(t, uint64(1), s.fallbacks.Load())
	require.NoError(t, regions.Balance())
	s.pool.close()
	require.Zero(t, host.HostBuffers())
}

func TestBeginFramePassesRefusals(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	addr, _ := host.Alloc(0, 1<<20)
	regions := transporttest.NewDevice(1 << 20)
	s := &stagingSink{inner: regions, dev: dev, slab: slab.DeviceMemory(addr, 1<<20, "cuda:0"), pool: newPool(1<<20, receiveRound), log: transporttest.Quiet()}
	res, tok := regions.Reserve(10)
	_, err := s.BeginFrame(res, ids.Token{9}, 0, 10)
	require.ErrorIs(t, err, transport.ErrBadToken)
	_, err = s.BeginFrame(res, tok, 5, 10)
	require.ErrorIs(t, err, transport.ErrOutOfBounds)
	require.NoError(t, regions.Balance())
}

// recordingTransport is a one-sided inner transport that keeps what it is
// asked to write, in place at Addr+Off as a slab would.
type recordingTransport struct {
	mu     sync.Mutex
	slab   []byte
	base   uint64
	frames []transport.WriteItem
	calls  int // Write calls
}

func (r *recordingTransport) Name() string { return "onesided" }
func (r *recordingTransport) Listen(string, transport.Sink) (transport.Receiver, error) {
	return nil, errors.New("not a receiver")
}
func (r *recordingTransport) NewWriter() transport.Writer { return r }
func (r *recordingTransport) Close() error                { return nil }
func (r *recordingTransport) Write(_ context.Context, _ string, items []transport.WriteItem) []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	errs := make([]error, len(items))
	for i, it := range items {
		r.frames = append(r.frames, it)
		if it.Dev != nil || it.Addr < r.base || it.Addr+it.Off+uint64(len(it.Src)) > r.base+uint64(len(r.slab)) ||
			it.Off+uint64(len(it.Src)) > it.Size {
			errs[i] = fmt.Errorf("frame [%d,+%d) at %#x (size %d) misplaced", it.Off, len(it.Src), it.Addr, it.Size)
			continue
		}
		copy(r.slab[it.Addr-r.base+it.Off:], it.Src)
	}
	return errs
}

// One-sided inner transports (mooncake without a CUDA engine, shm) place
// each staged chunk by the grant's remote address and size, which every
// chunk must keep.
func TestChunksKeepTheGrantForOneSidedTransports(t *testing.T) {
	host := gpu.NewFakeHost(1)
	inner := &recordingTransport{slab: make([]byte, 1<<20), base: 0x10000}
	w := New(Config{Inner: inner, Devices: host, ChunkBytes: chunk, StagingBytes: 4 * chunk, Logger: transporttest.Quiet()}).NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	data := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, (3*chunk+100)/7)
	addr, window := host.Alloc(0, len(data))
	copy(window, data)
	item := transport.WriteItem{Res: 7, Off: 512, Addr: inner.base + 4096, Size: 512 + uint64(len(data)),
		Dev: &transport.DeviceSrc{Addr: addr, Len: uint64(len(data))}}
	require.NoError(t, write(t, w, "peer", item)[0])
	require.Len(t, inner.frames, 4)
	require.Equal(t, data, inner.slab[4096+512:4096+512+len(data)])
}

// Small device items of one Write share staging buffers and reach the
// inner writer together: a budget of one chunk carries 16 items of a
// sixteenth of a chunk in one page-locked buffer and one inner Write, so
// that a plane which groups the frames of one call (TCP's writev) groups
// them, and the budget is not spent one whole chunk per small item.
func TestSmallDeviceItemsShareAStagingBuffer(t *testing.T) {
	host := gpu.NewFakeHost(1)
	inner := &recordingTransport{slab: make([]byte, 1<<20), base: 0x10000}
	w := New(Config{Inner: inner, Devices: host, ChunkBytes: chunk, StagingBytes: chunk, Logger: transporttest.Quiet()}).NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	const n, size = 16, chunk / 16
	items := make([]transport.WriteItem, n)
	want := make([][]byte, n)
	for i := range items {
		want[i] = transporttest.RandBytes(uint64(i), size)
		addr, window := host.Alloc(0, size)
		copy(window, want[i])
		items[i] = transport.WriteItem{Res: ids.ResID(i + 1), Addr: inner.base + uint64(i*size), Size: size,
			Dev: &transport.DeviceSrc{Addr: addr, Len: size}}
	}
	for i, err := range write(t, w, "peer", items...) {
		require.NoError(t, err, "item %d", i)
	}
	for i := range items {
		require.Equal(t, want[i], inner.slab[i*size:(i+1)*size], "item %d", i)
	}
	require.Equal(t, 1, inner.calls, "the items reach the inner writer in one call")
	require.Len(t, inner.frames, n)
	require.Equal(t, 1, host.HostBuffers(), "one page-locked buffer holds them all")
	require.Equal(t, 1, host.HostCopyBatches(), "their copies are one batch, waited for once")
}

// Packs are per device and bounded by the budget: small items of two
// devices, interleaved with items larger than a chunk, through a budget
// of two chunks (so packs wait for buffers to come back) all land
// bit-exact, and every buffer is freed once the writer closes.
func TestPacksOfTwoDevicesThroughASmallBudget(t *testing.T) {
	host := gpu.NewFakeHost(2)
	c := listen(t, host, false, 0)
	w := newWriter(t, host, 2*chunk)
	sizes := []int{100, chunk / 3, 2*chunk + 9, chunk / 2, 1, chunk, chunk/4 + 3, 3 * chunk, 4000, chunk / 3, chunk / 3}
	var items []transport.WriteItem
	var want [][]byte
	for i, n := range sizes {
		res, tok := c.regions.Reserve(uint64(n))
		data := transporttest.RandBytes(uint64(100+i), n)
		ordinal := i % 2
		addr, window := host.Alloc(ordinal, n)
		copy(window, data)
		items = append(items, transport.WriteItem{Res: res, Token: tok, Dev: &transport.DeviceSrc{Addr: addr, Len: uint64(n), Ordinal: ordinal}})
		want = append(want, data)
	}
	for i, err := range write(t, w, c.recv.Addr(), items...) {
		require.NoError(t, err, "item %d", i)
	}
	for i, it := range items {
		require.True(t, bytes.Equal(want[i], c.slabBytes(it.Res, sizes[i])), "item %d (%d bytes) differs", i, sizes[i])
	}
	require.NoError(t, c.regions.Balance())
	require.NoError(t, w.Close())
	require.Zero(t, host.HostBuffers(), "every page-locked buffer is freed once the writer is closed")
}
