package node

import (
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/valyala/fasthttp"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
)

var noGPU = gpu.Unavailable{Err: fmt.Errorf("%w: no GPU in this test", gpu.ErrUnavailable)}

// inmem keeps every object of a test off real control ports.
func inmem(devs gpu.Devices) Options {
	n := control.NewInmemNetwork()
	return Options{Log: slog.New(slog.DiscardHandler), Devices: devs, Control: func() control.Links { return n.Links("node-test") }}
}

func TestConsumerRefusesWhatCannotBeRight(t *testing.T) {
	cfg := config.DefaultConsumer()
	_, err := OpenConsumer(cfg, nil, inmem(noGPU))
	require.ErrorIs(t, err, config.ErrInvalid)
	require.EqualError(t, err, "consumer: slab is empty (pointer and nbytes must describe the receive buffer)")

	_, err = OpenConsumerDevice(cfg, 0x1000, 1<<20, -1, inmem(noGPU))
	require.ErrorIs(t, err, config.ErrInvalid)
	_, err = OpenConsumerDevice(cfg, 0, 1<<20, 0, inmem(noGPU))
	require.ErrorIs(t, err, config.ErrInvalid)

	_, err = OpenConsumerDevice(cfg, 0x1000, 1<<20, 0, inmem(noGPU))
	require.ErrorIs(t, err, ErrUnavailable, "a GPU slab in a process without a GPU")
	require.ErrorContains(t, err, "consumer: receive slab on cuda:0")

	host := gpu.NewFakeHost(1)
	_, err = OpenConsumerDevice(cfg, 0x1000, 1<<20, 0, inmem(host))
	require.ErrorIs(t, err, config.ErrInvalid, "memory the device does not hold")
}

// A GPU slab offers TCP staged through page-locked memory and cuda_ipc
// beside it; a host slab offers its one plane.
func TestConsumerPlanesFollowTheSlab(t *testing.T) {
	host := gpu.NewFakeHost(1)
	addr, _ := host.Alloc(0, 1<<20)
	cfg := config.DefaultConsumer()
	c, err := OpenConsumerDevice(cfg, addr, 1<<20, 0, inmem(host))
	require.NoError(t, err)
	planes := c.Stats().Planes
	require.Contains(t, planes, "tcp")
	require.Contains(t, planes, cudaipc.Name)
	require.NoError(t, c.Close())

	c, err = OpenConsumer(cfg, make([]byte, 1<<20), inmem(noGPU))
	require.NoError(t, err)
	require.Empty(t, c.Stats().Planes, "one plane, not a route")
	require.Equal(t, "tcp", c.Info().Transport)
	require.NoError(t, c.Close())
}

// The TCP receiver takes its handshake deadline from the settings, not
// the plane's default: an unproven connection holds a place that long.
func TestConsumerTCPTakesTheHandshakeTimeout(t *testing.T) {
	cfg := config.DefaultConsumer()
	cfg.DataHandshakeTimeoutS = 2.5
	tr, err := consumerNetwork(cfg, inmem(noGPU))
	require.NoError(t, err)
	require.IsType(t, &tcp.TCP{}, tr)
	require.Equal(t, 2500*time.Millisecond, tr.(*tcp.TCP).Config().HandshakeTimeout)
}

func TestMissingTransferEngineIsUnavailable(t *testing.T) {
	pcfg := config.DefaultProducer()
	pcfg.Transport, pcfg.Mooncake.Library = mooncake.Name, "/nonexistent/libtransfer_engine.so"
	_, err := OpenProducer(pcfg, inmem(noGPU))
	require.ErrorIs(t, err, ErrUnavailable)

	cfg := config.DefaultConsumer()
	cfg.Transport, cfg.Mooncake.Library = mooncake.Name, "/nonexistent/libtransfer_engine.so"
	_, err = OpenConsumer(cfg, make([]byte, 1<<20), inmem(noGPU))
	require.ErrorIs(t, err, ErrUnavailable)
}

// GPU sources without a GPU are refused as unavailable, item by item;
// host sources beside them are taken.
func TestSourcesDeviceSaysWhyItRefuses(t *testing.T) {
	p, err := OpenProducer(config.DefaultProducer(), inmem(noGPU))
	require.NoError(t, err)
	defer p.Close()
	ids, err := p.SourcesDevice([]DeviceSource{{MMHash: "h", Addr: 0x1000, N: 16, Ordinal: 0}})
	require.ErrorIs(t, err, ErrUnavailable)
	require.Zero(t, ids[0])

	ids, err = p.SourcesDevice([]DeviceSource{
		{MMHash: "host", Mem: make([]byte, 16), Ordinal: -1},
		{MMHash: "empty", Ordinal: -1},
	})
	require.ErrorIs(t, err, config.ErrInvalid, "an empty source is the caller's mistake")
	require.NotErrorIs(t, err, ErrUnavailable)
	require.ErrorContains(t, err, "1 of 2 sources refused")
	require.NotZero(t, ids[0])
	require.Zero(t, ids[1])

	host := gpu.NewFakeHost(1)
	p2, err := OpenProducer(config.DefaultProducer(), inmem(host))
	require.NoError(t, err)
	defer p2.Close()
	addr, _ := host.Alloc(0, 64)
	ids, err = p2.SourcesDevice([]DeviceSource{{MMHash: "a", Addr: addr, N: 32, Ordinal: 0}, {MMHash: "b", Addr: addr + 32, N: 32, Ordinal: 0}})
	require.NoError(t, err)
	require.NotZero(t, ids[0])
	require.NotZero(t, ids[1])
	// Counted as recorded, not as open: no push waits for these sources,
	// so the producer's driver may release them (and close the event)
	// before SourcesDevice's caller looks.
	require.Equal(t, 1, host.RecordedEvents(), "one event per stream, shared by its sources")
	require.Eventually(t, func() bool { return host.OpenEvents() == 0 }, 30*time.Second, time.Millisecond,
		"sources no push waits for are released, and their event closed with the last")
	require.Equal(t, 1, host.Checks(), "one check call for the device's sources")

	// A batch over two devices: one check call each, and a span past its
	// allocation is refused alone.
	two := gpu.NewFakeHost(2)
	p3, err := OpenProducer(config.DefaultProducer(), inmem(two))
	require.NoError(t, err)
	defer p3.Close()
	a0, _ := two.Alloc(0, 64)
	a1, _ := two.Alloc(1, 64)
	ids, err = p3.SourcesDevice([]DeviceSource{
		{MMHash: "d0-a", Addr: a0, N: 32, Ordinal: 0},
		{MMHash: "d1-a", Addr: a1, N: 64, Ordinal: 1},
		{MMHash: "d0-past", Addr: a0 + 32, N: 64, Ordinal: 0},
		{MMHash: "d0-b", Addr: a0 + 32, N: 32, Ordinal: 0},
		{MMHash: "d1-wrong-device", Addr: a0, N: 16, Ordinal: 1},
	})
	require.ErrorContains(t, err, "2 of 5 sources refused")
	require.ErrorContains(t, err, "item 2 (d0-past)")
	require.ErrorContains(t, err, "item 4 (d1-wrong-device)")
	require.NotZero(t, ids[0])
	require.NotZero(t, ids[1])
	require.Zero(t, ids[2])
	require.NotZero(t, ids[3])
	require.Zero(t, ids[4])
	require.Equal(t, 2, two.Checks(), "one check call a device")
	require.Equal(t, 2, two.RecordedEvents(), "one event a (device, stream)")
}

// The test serves through a Metrics of its own, not the process's, so
// that go test -count=N meets no port an earlier run left open.
func TestMetricsAreServedOnOnePort(t *testing.T) {
	free := func() int {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer l.Close()
		return l.Addr().(*net.TCPAddr).Port
	}
	log := slog.New(slog.DiscardHandler)
	r := config.DefaultRuntime()
	require.NoError(t, ServeMetrics(r, log), "no port, nothing served")

	var m Metrics
	defer m.Close()
	require.NoError(t, m.Serve(r, log), "no port, nothing served")
	require.Empty(t, m.Addr())
	r.MetricsIP, r.MetricsPort = "127.0.0.1", free()
	require.NoError(t, m.Serve(r, log))
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", r.MetricsPort), m.Addr())
	require.NoError(t, m.Serve(r, log), "the same port again is fine")
	status, _, err := fasthttp.Get(nil, "http://"+m.Addr()+"/health")
	require.NoError(t, err)
	require.Equal(t, fasthttp.StatusOK, status)

	other := r
	other.MetricsPort = free()
	require.ErrorIs(t, m.Serve(other, log), ErrState)
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", r.MetricsPort), m.Addr(), "the refused port changed nothing")

	require.NoError(t, m.Close())
	require.Empty(t, m.Addr())
	require.NoError(t, m.Serve(other, log), "closed, any port again")
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", other.MetricsPort), m.Addr())
}
