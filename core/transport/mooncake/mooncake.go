package mooncake

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Name is the transport's name in settings and peers replies.
const Name = "mooncake"

// Defaults applied to zero Config fields.
const (
	DefaultProtocol     = "rdma"
	DefaultStagingBytes = 256 << 20
	DefaultChunkBytes   = 4 << 20
	DefaultDrainTimeout = 30 * time.Second
)

// Config configures the transport of one process object.
type Config struct {
	// Library is the path of libtransfer_engine.so; "" searches the
	// loader's default path for DefaultLibrary.
	Library string
	// Engine is a Mooncake wheel's engine.so, which Library (then
	// ecmooncake's shim) carries; see load.
	Engine string
	// Metadata is P2PHANDSHAKE (also "") or http(s)://host:port/path.
	Metadata string
	// Protocol is installed on the engine; both ends must use the same.
	Protocol string
	// LocalServerName is the engine's segment name in HTTP metadata mode;
	// "" is host:port with a port the engine holds. In P2PHANDSHAKE mode
	// the engine names itself host:port and only the host part counts.
	LocalServerName string
	// Host is where peers reach this engine; on a consumer "" means the
	// host of the listen address, on a producer the host's outbound
	// address.
	Host string
	// StagingBytes sizes the producer's registered staging slab.
	StagingBytes int64
	// ChunkBytes caps one task: a larger item is cut into several, so that
	// copying one chunk into staging overlaps the transfer of the last.
	ChunkBytes uint64
	// DrainTimeout bounds how long a write waits, after its deadline, for
	// the engine to finish tasks it has already started (there is no
	// cancel), before it gives their batch and staging up for lost.
	DrainTimeout time.Duration
	// Devices resolves the GPUs of device sources (producer side).
	Devices gpu.Devices
	// GPUMemory, when set, says whether the engine registers GPU memory;
	// nil reads it from the engine library's build (see RegistersGPU).
	GPUMemory *bool
	Logger    *slog.Logger
}

// FromProducer and FromConsumer translate the settings.
func FromProducer(p config.Producer, log *slog.Logger) Config {
	return Config{
		Library: p.Library, Engine: p.Engine, Metadata: p.MooncakeMetadataURL(), Protocol: p.Protocol,
		LocalServerName: p.LocalServerName, Host: p.Mooncake.Host, StagingBytes: p.MooncakeStagingBytes, Logger: log,
	}
}

// FromConsumer translates a consumer shard's settings.
func FromConsumer(c config.Consumer, log *slog.Logger) Config {
	return Config{
		Library: c.Library, Engine: c.Engine, Metadata: c.MooncakeMetadataURL(), Protocol: c.Protocol,
		LocalServerName: c.LocalServerName, Host: c.Mooncake.Host, Logger: log,
	}
}

func (c Config) withDefaults() Config {
	if c.Protocol == "" {
		c.Protocol = DefaultProtocol
	}
	defaults.Positive(&c.StagingBytes, DefaultStagingBytes)
	if c.ChunkBytes == 0 {
		c.ChunkBytes = DefaultChunkBytes
	}
	// Four chunks in flight at least, so that one writer never has to
	// wait for its own last chunk to land before copying the next.
	c.ChunkBytes = min(c.ChunkBytes, uint64(c.StagingBytes)/4)
	defaults.Positive(&c.DrainTimeout, DefaultDrainTimeout)
	c.Devices = gpu.Configured(c.Devices, "mooncake staging")
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Transport moves bytes with Mooncake TransferEngine. Each Listen and each
// NewWriter owns one engine (a consumer shard listens once; a producer
// has one writer), created when it is first needed.
type Transport struct {
	cfg    Config
	lib    *library
	log    *slog.Logger
	gpu    bool   // the engine registers GPU memory
	gpuWhy string // how gpu was decided
}

var (
	_ transport.Transport   = (*Transport)(nil)
	_ transport.AddrChecker = (*Transport)(nil)
)

// New loads the library (once per process and path) and checks the
// settings; it creates no engine. Without the library the error wraps
// ErrUnavailable and names the path tried.
func New(cfg Config) (*Transport, error) {
	cfg = cfg.withDefaults()
	if err := config.MooncakeMetadata(cfg.Metadata); err != nil {
		return nil, err
	}
	lib, err := load(cfg.Library, cfg.Engine)
	if err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, lib: lib, log: cfg.Logger.With("transport", Name)}
	t.gpu, t.gpuWhy = gpuSupport(cfg, lib)
	return t, nil
}

// Name is "mooncake".
func (t *Transport) Name() string { return Name }

// CheckAddr refuses a consumer whose engine speaks another protocol.
func (t *Transport) CheckAddr(addr string) error {
	return transport.CheckParsed(addr, parsePeer, t.checkProto)
}

// receiver is a consumer shard's engine with its slab registered.
type receiver struct {
	eng       *engine
	p         peer
	closeOnce sync.Once
	closeErr  error
}

var _ transport.Direct = (*receiver)(nil)

// Listen creates the shard's engine, named after addr's host (or
// Config.Host), and registers the sink's whole slab with it once. The sink
// must be a transport.DirectSink.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	base, n, device, err := transport.DirectMemory(sink)
	if err != nil {
		return nil, fmt.Errorf("mooncake: listen %s: %w", addr, err)
	}
	if device != "" && device != "cpu" && !t.gpu {
		// A non-CUDA engine would take the device address for host memory.
		return nil, fmt.Errorf("mooncake: listen %s: the slab is on %s and this engine cannot register GPU memory (%s); install a CUDA build of the engine (mooncake-transfer-engine, or -cuda13 for CUDA 13)",
			addr, device, t.gpuWhy)
	}
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("mooncake: listen %s: %w", addr, err)
	}
	if t.cfg.Host != "" {
		host = t.cfg.Host
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		return nil, fmt.Errorf("mooncake: listen %s: %q is no address a peer can reach; set mooncake_host", addr, host)
	}
	port, _ := strconv.Atoi(portStr)
	eng, err := newEngine(t.lib, engineConfig{Metadata: t.cfg.Metadata, ServerName: t.cfg.LocalServerName, Host: host, Port: port, Protocol: t.cfg.Protocol, Log: t.log})
	if err != nil {
		return nil, err
	}
	if err := eng.register([]region{{addr: base, n: n}}, location(device)); err != nil {
		eng.destroy()
		return nil, err
	}
	r := &receiver{eng: eng, p: peer{Segment: eng.segment, Proto: t.cfg.Protocol, Base: uint64(base), Len: n, Epoch: newEpoch()}}
	t.log.Info("mooncake engine serving the slab", "segment", eng.segment, "protocol", t.cfg.Protocol, "bytes", n, "device", device)
	return r, nil
}

// location is Mooncake's name for where memory lives. "*" lets the engine
// find the NUMA node of host memory itself, so that it picks the NICs
// nearest to it.
func location(device string) string {
	if device == "" || device == "cpu" {
		return "*"
	}
	return device
}

func newEpoch() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b) // crypto/rand never fails on Linux
	return hex.EncodeToString(b)
}

func (r *receiver) Addr() string                     { return r.p.String() }
func (r *receiver) RemoteAddr(slabOff uint64) uint64 { return r.p.Base + slabOff }

// Stats is empty: one-sided writes never pass through the receiver.
func (r *receiver) Stats() transport.RecvStats {
	return transport.RecvStats{Rejected: map[string]uint64{}}
}

// Close unregisters the slab and destroys the engine; idempotent. After it
// the engine no longer accepts writes into the slab.
func (r *receiver) Close() error {
	r.closeOnce.Do(func() {
		if err := r.eng.destroy(); err != nil {
			r.closeErr = fmt.Errorf("mooncake: close receiver %s: %w", r.p.Segment, err)
		}
	})
	return r.closeErr
}

// outboundHostTowards is the address this host uses to reach the engine
// named segment ("host:port", as P2P handshake names segments): the source
// address of the route to it, which a UDP "connection" finds without
// sending anything. A segment that names no IP (a name in a metadata
// store) falls back to the default route's address. A host with no default
// route — a network namespace with only a link to its peers — would
// otherwise advertise 127.0.0.1, which a peer on another host cannot reach.
func outboundHostTowards(segment string) string {
	host, _, err := net.SplitHostPort(segment)
	if ip := net.ParseIP(host); err == nil && ip != nil {
		if c, err := net.Dial("udp", net.JoinHostPort(ip.String(), "9")); err == nil {
			defer c.Close()
			if a, ok := c.LocalAddr().(*net.UDPAddr); ok && !a.IP.IsUnspecified() {
				return a.IP.String()
			}
		}
	}
	return outboundHost()
}

// outboundHost is the address this host uses to reach others: a UDP
// "connection" sends nothing, but makes the kernel pick the source
// address of its default route.
func outboundHost() string {
	c, err := net.Dial("udp", "192.0.2.1:9")
	if err != nil {
		return "127.0.0.1"
	}
	defer c.Close()
	if a, ok := c.LocalAddr().(*net.UDPAddr); ok && !a.IP.IsUnspecified() {
		return a.IP.String()
	}
	return "127.0.0.1"
}
