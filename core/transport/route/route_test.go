package route

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

// lines records log messages.
type lines struct {
	mu   sync.Mutex
	msgs []string
}

func (l *lines) Enabled(context.Context, slog.Level) bool { return true }
func (l *lines) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	l.msgs = append(l.msgs, b.String())
	return nil
}
func (l *lines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *lines) WithGroup(string) slog.Handler      { return l }

func (l *lines) count(sub string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, sub) {
			n++
		}
	}
	return n
}

type named string

func (n named) Name() string { return string(n) }
func (n named) Listen(string, transport.Sink) (transport.Receiver, error) {
	return nil, errors.New("no")
}
func (n named) NewWriter() transport.Writer { return nil }

func TestPick(t *testing.T) {
	both := map[string]string{"tcp": "10.0.0.2:1", "cuda_ipc": "10.0.0.2:2"}
	tcpOnly := map[string]string{"tcp": "10.0.0.2:1"}
	cases := []struct {
		name      string
		local     transport.Transport
		localOff  string
		overrides map[string]string
		host      string
		offered   map[string]string
		want      string // destination, or an error substring after "!"
		why       string
	}{
		{"same host picks cuda_ipc", named("cuda_ipc"), "", nil, "h1", both, "cuda_ipc://10.0.0.2:2", "same host"},
		{"other host picks the network", named("cuda_ipc"), "", nil, "h2", both, "tcp://10.0.0.2:1", "other host"},
		{"same host without a GPU here", nil, "no CUDA driver", nil, "h1", both, "tcp://10.0.0.2:1", "no CUDA driver"},
		{"same host, shard offers no cuda_ipc", named("cuda_ipc"), "", nil, "h1", tcpOnly, "tcp://10.0.0.2:1", "offers no cuda_ipc"},
		{"override by peer", named("cuda_ipc"), "", map[string]string{"tcp://peer:1": "tcp"}, "h1", both, "tcp://10.0.0.2:1", "configured for tcp://peer:1"},
		{"override by host", named("cuda_ipc"), "", map[string]string{"h2": "cuda_ipc"}, "h2", both, "cuda_ipc://10.0.0.2:2", "configured for h2"},
		{"override to a transport missing here", nil, "no CUDA driver", map[string]string{"h1": "cuda_ipc"}, "h1", both, "!not available in this process: no CUDA driver", ""},
		{"override to a plane the shard lacks", named("cuda_ipc"), "", map[string]string{"h2": "cuda_ipc"}, "h2", tcpOnly, "!offers no cuda_ipc", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			log := &lines{}
			r := New(Config{Network: named("tcp"), Local: tc.local, LocalOff: tc.localOff, Host: "h1", Overrides: tc.overrides, Logger: slog.New(log)})
			got, err := r.Pick("tcp://peer:1", tc.host, tc.offered)
			if want, isErr := strings.CutPrefix(tc.want, "!"); isErr {
				require.ErrorContains(t, err, want)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			_, _ = r.Pick("tcp://peer:1", tc.host, tc.offered)
			require.Equal(t, 1, log.count("data plane chosen"), "logged once per peer")
			require.Equal(t, 1, log.count(tc.why))
		})
	}
}

// consumer is a shard over a fake GPU slab offering both data planes.
func consumer(t *testing.T, host *gpu.FakeHost) (*transporttest.Regions, []byte, transport.Receiver) {
	t.Helper()
	dev, _ := host.Device(0)
	const size = 4 << 20
	addr, window := host.Alloc(0, size)
	mem := slab.DeviceMemory(addr, size, dev.Name())
	regions := transporttest.NewDevice(size)
	r := New(Config{
		Network: staged.New(staged.Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Slab: mem, SlabDevice: dev, Logger: transporttest.Quiet()}),
		Local:   cudaipc.New(cudaipc.Config{Slab: mem, SlabDevice: dev, Logger: transporttest.Quiet()}),
		Host:    "h1", Logger: transporttest.Quiet(),
	})
	recv, err := r.Listen("127.0.0.1:0", regions)
	require.NoError(t, err)
	t.Cleanup(func() { _ = recv.Close() })
	return regions, window, recv
}

func producer(host *gpu.FakeHost, name string) *Transport {
	return New(Config{
		Network: staged.New(staged.Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Devices: host, Logger: transporttest.Quiet()}),
		Local:   cudaipc.New(cudaipc.Config{Devices: host, Logger: transporttest.Quiet()}),
		Host:    name, Logger: transporttest.Quiet(),
	})
}

func TestEndToEndOverEitherPlane(t *testing.T) {
	for _, tc := range []struct{ host, plane string }{{"h1", "cuda_ipc"}, {"h2", "tcp"}} {
		t.Run(tc.plane, func(t *testing.T) {
			gpus := gpu.NewFakeHost(1)
			regions, window, recv := consumer(t, gpus)
			offer := transport.Offer(recv, "tcp")
			require.Equal(t, []string{"cuda_ipc", "tcp"}, transport.Names(offer))
			require.Equal(t, offer["tcp"], recv.Addr())

			p := producer(gpus, tc.host)
			dest, err := transport.PickDest(p, "tcp://shard:1", "h1", offer)
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(dest, tc.plane+"://"), dest)
			w := p.NewWriter()
			defer w.Close()

			data := bytes.Repeat([]byte("encoder output "), 10000)
			src, srcWindow := gpus.Alloc(0, len(data))
			copy(srcWindow, data)
			res, tok := regions.Reserve(uint64(len(data)))
			hres, htok := regions.Reserve(5)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// Grants carry the one-sided plane's address of each region,
			// as a shard's do; TCP ignores it.
			direct, ok := transport.DirectOf(recv)
			require.True(t, ok, "cuda_ipc is the shard's one-sided plane")
			errs := w.Write(ctx, dest, []transport.WriteItem{
				{Res: res, Token: tok, Dev: &transport.DeviceSrc{Addr: src, Len: uint64(len(data))}, Addr: direct.RemoteAddr(regions.Offset(res)), Size: uint64(len(data))},
				{Res: hres, Token: htok, Src: []byte("hello"), Addr: direct.RemoteAddr(regions.Offset(hres)), Size: 5},
			})
			require.NoError(t, errs[0])
			require.NoError(t, errs[1])
			off := regions.Offset(res)
			require.Equal(t, data, window[off:off+uint64(len(data))])
			hoff := regions.Offset(hres)
			require.Equal(t, []byte("hello"), window[hoff:hoff+5])
			planes := recv.(interface {
				PlaneStats() map[string]transport.RecvStats
			}).PlaneStats()
			if tc.plane == "tcp" {
				require.Equal(t, uint64(2), planes["tcp"].Frames, "one frame per item")
			} else {
				require.Zero(t, planes["tcp"].Frames, "cuda_ipc carried them, straight into the slab")
				require.Equal(t, 1, gpus.OpenMappings())
			}
			require.NoError(t, regions.Balance())
		})
	}
}

func TestUnreachableLocalFallsBackToTheNetwork(t *testing.T) {
	gpus := gpu.NewFakeHost(1)
	regions, window, recv := consumer(t, gpus)
	offer := transport.Offer(recv, "tcp")
	p := producer(gpus, "h1")
	w := p.NewWriter()
	defer w.Close()
	dest, err := p.Pick("tcp://shard:1", "h1", offer)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(dest, "cuda_ipc://"))

	// The slab's handle does not open (as where IPC between these
	// processes is not allowed).
	gpus.FailNextOpens(errors.New("injected: operation not permitted"))
	res, tok := regions.Reserve(5)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	direct, _ := transport.DirectOf(recv)
	errs := w.Write(ctx, dest, []transport.WriteItem{{Res: res, Token: tok, Src: []byte("first"), Addr: direct.RemoteAddr(regions.Offset(res)), Size: 5}})
	require.ErrorIs(t, errs[0], transport.ErrUnsupported)

	dest, err = p.Pick("tcp://shard:1", "h1", offer)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(dest, "tcp://"), "the next choice for that shard is the network: %s", dest)
	res2, tok2 := regions.Reserve(6)
	require.NoError(t, w.Write(ctx, dest, []transport.WriteItem{{Res: res2, Token: tok2, Src: []byte("second")}})[0])
	off := regions.Offset(res2)
	require.Equal(t, []byte("second"), window[off:off+6])
}

func TestTheOneSidedPlaneNamesRegionsBySlabAddress(t *testing.T) {
	gpus := gpu.NewFakeHost(1)
	_, _, recv := consumer(t, gpus)
	direct, ok := transport.DirectOf(recv)
	require.True(t, ok)
	require.NotZero(t, direct.RemoteAddr(0))
	require.Equal(t, direct.RemoteAddr(0)+4096, direct.RemoteAddr(4096), "a region's address is the slab's plus its offset")

	tcpOnly, err := New(Config{Network: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Host: "h1", Logger: transporttest.Quiet()}).Listen("127.0.0.1:0", transporttest.NewHost(10))
	require.NoError(t, err)
	defer tcpOnly.Close()
	_, ok = transport.DirectOf(tcpOnly)
	require.False(t, ok, "TCP alone is no one-sided plane")
}

type failingListen struct{ named }

func TestLocalThatCannotListenIsLeftOut(t *testing.T) {
	log := &lines{}
	r := New(Config{Network: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Local: failingListen{"cuda_ipc"}, Host: "h1", Logger: slog.New(log)})
	recv, err := r.Listen("127.0.0.1:0", transporttest.NewHost(10))
	require.NoError(t, err)
	defer recv.Close()
	require.Equal(t, []string{"tcp"}, transport.Names(transport.Offer(recv, "tcp")))
	require.Equal(t, 1, log.count("serving over the network only"))
}

func TestUnknownSchemeFails(t *testing.T) {
	r := New(Config{Network: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Host: "h1", Logger: transporttest.Quiet()})
	w := r.NewWriter()
	defer w.Close()
	errs := w.Write(context.Background(), "cuda_ipc://127.0.0.1:1", []transport.WriteItem{{Res: 1, Src: []byte("x")}})
	require.ErrorContains(t, errs[0], `no "cuda_ipc" transport in this process`)
}
