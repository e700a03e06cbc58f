package cudaipc

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 11))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

const slabSize = 8 << 20

// shard is a consumer shard's side: a device slab, its table, a receiver.
type shard struct {
	host    *gpu.FakeHost
	addr    uintptr
	window  []byte
	regions *transporttest.Regions
	recv    transport.Receiver
}

func listenShard(t *testing.T, host *gpu.FakeHost, ordinal int, at string) *shard {
	t.Helper()
	dev, err := host.Device(ordinal)
	require.NoError(t, err)
	// The slab starts 4 KiB into its allocation, as a PyTorch tensor can.
	base, window := host.Alloc(ordinal, slabSize+4096)
	s := &shard{host: host, addr: base + 4096, window: window[4096:], regions: transporttest.NewDevice(slabSize)}
	tr := New(Config{Slab: slab.DeviceMemory(s.addr, slabSize, dev.Name()), SlabDevice: dev, Logger: quiet()})
	s.recv, err = tr.Listen(at, s.regions)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.recv.Close() })
	return s
}

func (s *shard) region(res ids.ResID, n int) []byte {
	off := s.regions.Offset(res)
	return s.window[off : off+uint64(n)]
}

func newWriter(t *testing.T, host *gpu.FakeHost) transport.Writer {
	t.Helper()
	w := New(Config{Devices: host, Logger: quiet()}).NewWriter()
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
				data := randBytes(uint64(i), n)
				res, tok := s.regions.Reserve(uint64(n))
				it := transport.WriteItem{Res: res, Token: tok}
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
				require.True(t, bytes.Equal(want[i], s.region(it.Res, len(want[i]))), "item %d differs", i)
			}
			require.NoError(t, s.regions.Balance())
			st := s.recv.Stats()
			require.Equal(t, uint64(len(items)), st.Frames)
			require.Positive(t, host.OpenMappings(), "the writer keeps the shard's slab open between writes")
			require.NoError(t, w.Close())
			require.Zero(t, host.OpenMappings(), "Close closes every mapping")
		})
	}
}

func TestRefusalsCostOnlyTheirItem(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	good, goodTok := s.regions.Reserve(100)
	small, smallTok := s.regions.Reserve(10)
	gone, goneTok := s.regions.Reserve(10)
	s.regions.Drop(gone)
	data := randBytes(1, 100)
	src := deviceSource(host, 0, data)
	items := []transport.WriteItem{
		{Res: good, Token: ids.Token{7}, Dev: src},
		{Res: 999, Token: goodTok, Dev: src},
		{Res: small, Token: smallTok, Dev: src},
		{Res: gone, Token: goneTok, Dev: src},
		{Res: good, Token: goodTok, Dev: src},
	}
	errs := write(w, s.recv.Addr(), items...)
	for i, want := range []error{transport.ErrBadToken, transport.ErrUnknownRes, transport.ErrOutOfBounds, transport.ErrGone} {
		require.ErrorIs(t, errs[i], want, "item %d", i)
		require.ErrorIs(t, errs[i], transport.ErrRejected)
	}
	require.NoError(t, errs[4])
	require.Equal(t, data, s.region(good, 100))
	require.NoError(t, s.regions.Balance())
	require.Equal(t, uint64(1), s.recv.Stats().Rejected["bad_token"])
}

func TestSourceIsReadOnlyAfterItsEvent(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	dev, _ := host.Device(0)
	const n = 3 << 20
	addr, window := host.Alloc(0, n)
	src := &transport.DeviceSrc{Addr: addr, Len: n}
	stream := host.NewStream()
	stream.Hold()
	ready, err := dev.RecordEvent(stream.Handle())
	require.NoError(t, err)
	src.Ready = ready
	res, tok := s.regions.Reserve(n)
	done := make(chan []error, 1)
	go func() { done <- write(w, s.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Dev: src}) }()
	final := randBytes(5, n)
	copy(window, final)
	stream.Release()
	require.NoError(t, (<-done)[0])
	require.True(t, bytes.Equal(final, s.region(res, n)), "the slab holds what the kernel finished writing")
}

func TestCopyFailureTearsTheFrame(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	res, tok := s.regions.Reserve(100)
	host.FailNextCopies(errors.New("injected copy failure"))
	errs := write(w, s.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Dev: deviceSource(host, 0, randBytes(1, 100))})
	require.ErrorContains(t, errs[0], "injected copy failure")
	require.True(t, s.regions.Torn(res), "the frame ends torn, so the shard will not publish it")
	require.NoError(t, s.regions.Balance())
}

func TestUnopenableHandleIsUnsupported(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.NoError(t, host.Free(s.addr-4096))
	res, tok := s.regions.Reserve(10)
	errs := write(w, s.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Src: []byte("0123456789")})
	require.ErrorIs(t, errs[0], transport.ErrUnsupported)
	require.True(t, s.regions.Torn(res))

	res2, tok2 := s.regions.Reserve(10)
	errs = write(w, s.recv.Addr(), transport.WriteItem{Res: res2, Token: tok2, Dev: &transport.DeviceSrc{Addr: 1, Len: 10, Ordinal: 5}})
	require.ErrorIs(t, errs[0], transport.ErrUnsupported, "a source on a device this process lacks")
	require.ErrorIs(t, errs[0], gpu.ErrUnavailable)
	require.NoError(t, s.regions.Balance())
}

func TestShardRestartInvalidatesTheMapping(t *testing.T) {
	host := gpu.NewFakeHost(1)
	first := listenShard(t, host, 0, "127.0.0.1:0")
	addr := first.recv.Addr()
	w := newWriter(t, host)
	res, tok := first.regions.Reserve(10)
	require.NoError(t, write(w, addr, transport.WriteItem{Res: res, Token: tok, Src: []byte("first life")})[0])
	require.Equal(t, 1, host.OpenMappings())

	// The shard's process dies and a new one listens at the same address
	// over a new slab.
	require.NoError(t, first.recv.Close())
	require.NoError(t, host.Free(first.addr-4096))
	second := listenShard(t, host, 0, addr)
	res2, tok2 := second.regions.Reserve(11)
	require.NoError(t, write(w, addr, transport.WriteItem{Res: res2, Token: tok2, Src: []byte("second life")})[0])
	require.Equal(t, []byte("second life"), second.region(res2, 11))
	require.Equal(t, 1, host.OpenMappings(), "the first life's mapping is closed, the second's is open")

	// A grant from the first life means nothing to the second.
	errs := write(w, addr, transport.WriteItem{Res: res, Token: tok, Src: []byte("first life")})
	require.ErrorIs(t, errs[0], transport.ErrRejected)
}

func TestConnectionLostMidWrite(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	dev, _ := host.Device(0)
	src := deviceSource(host, 0, randBytes(1, 100))
	stream := host.NewStream()
	stream.Hold()
	src.Ready, _ = dev.RecordEvent(stream.Handle())
	res, tok := s.regions.Reserve(100)
	done := make(chan []error, 1)
	go func() { done <- write(w, s.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Dev: src}) }()
	// The frame is admitted and the copy waits for the source: the shard
	// goes away now.
	require.Eventually(t, func() bool { return s.regions.Frames() == 1 }, 10*time.Second, time.Millisecond)
	require.NoError(t, s.recv.Close())
	stream.Release()
	errs := <-done
	require.ErrorIs(t, errs[0], transport.ErrConnLost)
	require.True(t, s.regions.Torn(res), "the shard ended the frame torn when the connection dropped")
	require.NoError(t, s.regions.Balance())
	require.Zero(t, host.OpenMappings(), "a lost connection closes the mapping")
}

func TestWriterClosed(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.NoError(t, w.Close())
	require.NoError(t, w.Close())
	res, tok := s.regions.Reserve(10)
	require.ErrorIs(t, write(w, s.recv.Addr(), transport.WriteItem{Res: res, Token: tok, Src: make([]byte, 10)})[0], transport.ErrClosed)
}

func TestListenNeedsADeviceSlabAndRegionSink(t *testing.T) {
	_, err := New(Config{}).Listen("127.0.0.1:0", transporttest.NewHost(10))
	require.ErrorContains(t, err, "slab in GPU memory")
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	addr, _ := host.Alloc(0, 1<<20)
	tr := New(Config{Slab: slab.DeviceMemory(addr, 1<<20, "cuda:0"), SlabDevice: dev})
	_, err = tr.Listen("127.0.0.1:0", hostOnly{})
	require.ErrorContains(t, err, "no RegionSink")
}

type hostOnly struct{}

func (hostOnly) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) { return nil, nil }
func (hostOnly) EndWrite(ids.ResID, bool)                                        {}
