package cudaipc

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

const slabSize = 8 << 20

// shard is a consumer shard's side: a device slab, a table that hands out
// its regions, and the receiver that exports it.
type shard struct {
	host    *gpu.FakeHost
	addr    uintptr
	window  []byte
	regions *transporttest.Regions
	recv    *receiver
}

func listenShard(t testing.TB, host *gpu.FakeHost, ordinal int, at string) *shard {
	t.Helper()
	dev, err := host.Device(ordinal)
	require.NoError(t, err)
	// The slab starts 4 KiB into its allocation, as a PyTorch tensor can.
	base, window := host.Alloc(ordinal, slabSize+4096)
	s := &shard{host: host, addr: base + 4096, window: window[4096:], regions: transporttest.NewDevice(slabSize)}
	tr := New(Config{Slab: slab.DeviceMemory(s.addr, slabSize, dev.Name()), SlabDevice: dev, Logger: transporttest.Quiet()})
	r, err := tr.Listen(at, s.regions)
	require.NoError(t, err)
	s.recv = r.(*receiver)
	t.Cleanup(func() { _ = s.recv.Close() })
	return s
}

// grant reserves n bytes and returns the write item a producer gets for
// it: reservation, token, and the region's address and size, as a shard
// puts them in a write grant.
func (s *shard) grant(n int) transport.WriteItem {
	res, tok := s.regions.Reserve(uint64(n))
	return transport.WriteItem{Res: res, Token: tok, Addr: s.recv.RemoteAddr(s.regions.Offset(res)), Size: uint64(n)}
}

func (s *shard) region(it transport.WriteItem) []byte {
	off := s.regions.Offset(it.Res)
	return s.window[off : off+it.Size]
}

func newWriter(t *testing.T, host *gpu.FakeHost) transport.Writer {
	t.Helper()
	w := New(Config{Devices: host, Logger: transporttest.Quiet()}).NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func write(w transport.Writer, dest string, items ...transport.WriteItem) []error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return w.Write(ctx, dest, items)
}

// deviceSource puts data in device memory of a fake GPU.
func deviceSource(host *gpu.FakeHost, ordinal int, data []byte) *transport.DeviceSrc {
	addr, window := host.Alloc(ordinal, len(data))
	copy(window, data)
	return &transport.DeviceSrc{Addr: addr, Len: uint64(len(data)), Ordinal: ordinal}
}

func TestWritesLandInTheSlab(t *testing.T) {
	cases := []struct {
		name          string
		slabGPU, srcs []int // srcs: ordinal per item, -1 for a host source
	}{
		{"same GPU", []int{0}, []int{0, 0, 0}},
		{"peer GPU", []int{1}, []int{0, 0}},
		{"host sources", []int{0}, []int{-1, -1}},
		{"mixed sources", []int{1}, []int{0, -1, 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			host := gpu.NewFakeHost(2)
			s := listenShard(t, host, tc.slabGPU[0], "127.0.0.1:0")
			w := newWriter(t, host)
			var items []transport.WriteItem
			var want [][]byte
			for i, ord := range tc.srcs {
				n := 1000 + i*(1<<20)
				data := transporttest.RandBytes(uint64(i), n)
				it := s.grant(n)
				if ord < 0 {
					it.Src = data
				} else {
					it.Dev = deviceSource(host, ord, data)
				}
				items, want = append(items, it), append(want, data)
			}
			for i, err := range write(w, s.recv.Addr(), items...) {
				require.NoError(t, err, "item %d", i)
			}
			for i, it := range items {
				require.True(t, bytes.Equal(want[i], s.region(it)), "item %d differs", i)
			}
			require.Zero(t, s.regions.Frames(), "a one-sided write never asks the shard's table")
			require.Positive(t, host.OpenMappings(), "the writer keeps the shard's slab open between writes")
			require.NoError(t, w.Close())
			require.Zero(t, host.OpenMappings(), "Close closes every mapping")
		})
	}
}

// TestNoDataPlaneExchangePerBatch counts the requests the shard's socket
// serves: one hello for the writer's first batch, none for the batches
// after it. What a batch costs on the control plane (reserve and complete)
// is all it costs.
func TestNoDataPlaneExchangePerBatch(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	const batches = 5
	for b := range batches {
		var items []transport.WriteItem
		for i := range 4 {
			it := s.grant(4096)
			it.Dev = deviceSource(host, 0, transporttest.RandBytes(uint64(10*b+i), 4096))
			items = append(items, it)
		}
		for i, err := range write(w, s.recv.Addr(), items...) {
			require.NoError(t, err, "batch %d item %d", b, i)
		}
	}
	require.Equal(t, uint64(1), s.recv.requests.Load(), "one hello, then no exchange per batch")
	require.Equal(t, uint64(1), s.recv.Stats().Attached)
}

// TestWriterRefusesGrantsOutsideTheSlab: the writer checks each item
// against the region its grant reserved and the region against the slab
// the shard exported; a refused item copies nothing and costs only itself.
func TestWriterRefusesGrantsOutsideTheSlab(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	src := deviceSource(host, 0, transporttest.RandBytes(1, 100))
	good := s.grant(100)
	good.Dev = src
	noAddr := good
	noAddr.Addr = 0
	pastGrant := s.grant(50)
	pastGrant.Dev = src // 100 bytes into a 50-byte region
	pastSlab := good
	pastSlab.Addr = s.recv.RemoteAddr(slabSize - 40)
	below := good
	below.Addr = s.recv.RemoteAddr(0) - 256
	wrapped := good
	wrapped.Addr, wrapped.Size = s.recv.RemoteAddr(0), ^uint64(0)-10
	wrapped.Off = 20
	before := bytes.Clone(s.window)
	errs := write(w, s.recv.Addr(), noAddr, pastGrant, pastSlab, below, wrapped, good)
	require.ErrorContains(t, errs[0], "no slab address")
	require.ErrorIs(t, errs[1], transport.ErrWriteBounds)
	for i := 2; i <= 4; i++ {
		require.ErrorIs(t, errs[i], transport.ErrStaleAddr, "item %d", i)
		require.ErrorIs(t, errs[i], transport.ErrRefusedByWriter)
	}
	require.NoError(t, errs[5])
	off := s.regions.Offset(good.Res)
	copy(before[off:], transporttest.RandBytes(1, 100))
	require.Equal(t, before, s.window, "only the good item's region changed")
}

func TestSourceIsReadOnlyAfterItsEvent(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	dev, _ := host.Device(0)
	const n = 3 << 20
	addr, window := host.Alloc(0, n)
	stream := host.NewStream()
	stream.Hold()
	ready, err := dev.RecordEvent(stream.Handle())
	require.NoError(t, err)
	it := s.grant(n)
	it.Dev = &transport.DeviceSrc{Addr: addr, Len: n, Ready: ready}
	done := make(chan []error, 1)
	go func() { done <- write(w, s.recv.Addr(), it) }()
	final := transporttest.RandBytes(5, n)
	copy(window, final)
	stream.Release()
	require.NoError(t, (<-done)[0])
	require.True(t, bytes.Equal(final, s.region(it)), "the slab holds what the kernel finished writing")
}

// TestBatchesToOneShardOverlap: a batch whose copies wait for their
// source does not hold up the next batch to the same shard, so that a
// busy encoder keeps several batches in flight.
func TestBatchesToOneShardOverlap(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	dev, _ := host.Device(0)
	stream := host.NewStream()
	stream.Hold()
	slow := s.grant(100)
	slow.Dev = deviceSource(host, 0, transporttest.RandBytes(1, 100))
	slow.Dev.Ready, _ = dev.RecordEvent(stream.Handle())
	done := make(chan []error, 1)
	go func() { done <- write(w, s.recv.Addr(), slow) }()
	fast := s.grant(100)
	fast.Dev = deviceSource(host, 0, transporttest.RandBytes(2, 100))
	require.NoError(t, write(w, s.recv.Addr(), fast)[0], "the second batch lands while the first waits")
	select {
	case <-done:
		t.Fatal("the first batch ended before its source was ready")
	default:
	}
	stream.Release()
	require.NoError(t, (<-done)[0])
	require.Equal(t, transporttest.RandBytes(1, 100), s.region(slow))
}

func TestCopyFailureFailsItsItems(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	it := s.grant(100)
	it.Dev = deviceSource(host, 0, transporttest.RandBytes(1, 100))
	host.FailNextCopies(errors.New("injected copy failure"))
	errs := write(w, s.recv.Addr(), it)
	require.ErrorContains(t, errs[0], "injected copy failure")
	require.NoError(t, write(w, s.recv.Addr(), it)[0], "the next write copies again")
}

func TestUnopenableHandleIsUnsupported(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.NoError(t, host.Free(s.addr-4096))
	it := s.grant(10)
	it.Src = []byte("0123456789")
	require.ErrorIs(t, write(w, s.recv.Addr(), it)[0], transport.ErrUnsupported)

	it2 := s.grant(10)
	it2.Dev = &transport.DeviceSrc{Addr: 1, Len: 10, Ordinal: 5}
	errs := write(w, s.recv.Addr(), it2)
	require.ErrorIs(t, errs[0], transport.ErrUnsupported, "a source on a device this process lacks")
	require.ErrorIs(t, errs[0], gpu.ErrUnavailable)
}

// TestShardRestartIsANewAddress: a shard that restarts at the same port
// publishes a new address (a new nonce); the writer maps the new slab for
// it, closes the old mapping, and refuses what names the old one.
func TestShardRestartIsANewAddress(t *testing.T) {
	host := gpu.NewFakeHost(1)
	first := listenShard(t, host, 0, "127.0.0.1:0")
	oldAddr := first.recv.Addr()
	w := newWriter(t, host)
	it := first.grant(10)
	it.Src = []byte("first life")
	require.NoError(t, write(w, oldAddr, it)[0])
	require.Equal(t, 1, host.OpenMappings())

	// The shard's process dies and a new one listens over a new slab.
	require.NoError(t, first.recv.Close())
	require.NoError(t, host.Free(first.addr-4096))
	second := listenShard(t, host, 0, "127.0.0.1:0")
	newAddr := second.recv.Addr()
	require.NotEqual(t, oldAddr, newAddr)
	it2 := second.grant(11)
	it2.Src = []byte("second life")
	require.NoError(t, write(w, newAddr, it2)[0])
	require.Equal(t, []byte("second life"), second.region(it2))
	require.Eventually(t, func() bool { return host.OpenMappings() == 1 }, 10*time.Second, time.Millisecond,
		"the first life's mapping is closed (its connection ended), the second's is open")

	// A grant of the first life is refused before any byte is copied.
	errs := write(w, oldAddr, it)
	require.ErrorIs(t, errs[0], transport.ErrUnreachable)
	require.Equal(t, 1, host.OpenMappings(), "a stale address leaves the live mapping alone")
	require.NoError(t, write(w, newAddr, it2)[0])
	require.Eventually(t, func() bool { return w.(*writer).Stats().Regions == 1 }, 10*time.Second, time.Millisecond,
		"the first life's ready-word region is unmapped, the second's is mapped")
}

func TestShardGoneClosesTheMapping(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	it := s.grant(10)
	it.Src = make([]byte, 10)
	require.NoError(t, write(w, s.recv.Addr(), it)[0])
	require.Equal(t, 1, host.OpenMappings())
	require.NoError(t, s.recv.Close())
	require.Eventually(t, func() bool { return host.OpenMappings() == 0 }, 10*time.Second, time.Millisecond,
		"a mapping keeps the exporter's memory alive: it closes once the shard is gone")
	require.ErrorIs(t, write(w, s.recv.Addr(), it)[0], transport.ErrUnreachable)
}

// TestHelloNeedsTheNonce: the slab's handle goes only to a peer that
// presents the nonce the shard published on the control plane.
func TestHelloNeedsTheNonce(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	p, err := parseAddr(s.recv.Addr())
	require.NoError(t, err)
	c, err := net.Dial("unix", "@"+p.socket)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(appendHello(nil, [nonceLen]byte{1}))
	require.NoError(t, err)
	rep, err := readHelloReply(c)
	require.NoError(t, err)
	require.Equal(t, statusBadNonce, rep.status)
	require.Equal(t, gpu.IPCHandle{}, rep.hello.Export.Handle, "no handle for a wrong nonce")
	require.Eventually(t, func() bool { return s.recv.Stats().Rejected["bad_nonce"] == 1 }, 5*time.Second, time.Millisecond)
}

func TestWriterClosed(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.NoError(t, w.Close())
	require.NoError(t, w.Close())
	it := s.grant(10)
	it.Src = make([]byte, 10)
	require.ErrorIs(t, write(w, s.recv.Addr(), it)[0], transport.ErrClosed)
}

func TestListenNeedsADeviceSlab(t *testing.T) {
	_, err := New(Config{}).Listen("127.0.0.1:0", transporttest.NewHost(10))
	require.ErrorContains(t, err, "slab in GPU memory")
}

// A shard greets at most MaxConns producers at once; the rest are cut at
// once and counted, and a slot that frees up serves the next one.
func TestShardCapsItsConnections(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, err := host.Device(0)
	require.NoError(t, err)
	base, window := host.Alloc(0, slabSize)
	regions := transporttest.NewDevice(slabSize)
	rcv, err := New(Config{Slab: slab.DeviceMemory(base, slabSize, dev.Name()), SlabDevice: dev, MaxConns: 2, Logger: transporttest.Quiet()}).Listen("127.0.0.1:0", regions)
	require.NoError(t, err)
	defer rcv.Close()
	p, err := parseAddr(rcv.Addr())
	require.NoError(t, err)
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("unix", "@"+p.socket)
		require.NoError(t, err)
		defer c.Close()
		idle = append(idle, c)
	}
	w := newWriter(t, host)
	res, tok := regions.Reserve(1)
	it := transport.WriteItem{Res: res, Token: tok, Addr: rcv.(transport.Direct).RemoteAddr(regions.Offset(res)), Size: 1, Src: []byte{9}}
	require.ErrorIs(t, write(w, rcv.Addr(), it)[0], transport.ErrUnreachable)
	require.NotZero(t, rcv.Stats().Closed[transport.ClosedLimit])
	require.Zero(t, window[regions.Offset(res)])

	idle[0].Close()
	require.Eventually(t, func() bool { return write(w, rcv.Addr(), it)[0] == nil }, 10*time.Second, time.Millisecond)
	require.Equal(t, byte(9), window[regions.Offset(res)])
}
