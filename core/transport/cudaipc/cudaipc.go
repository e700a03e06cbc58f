package cudaipc

import (
	"errors"
	"log/slog"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Name is the transport's name in the shards' peers reply and in config.
const Name = "cuda_ipc"

// Defaults applied to zero Config fields.
const (
	// DefaultDialTimeout bounds one connection attempt and its hello.
	DefaultDialTimeout = 5 * time.Second
	// DefaultMaxConns caps the producer connections a shard's socket
	// holds at once: each producer process holds one per shard.
	DefaultMaxConns = 1024
)

// Config wires the transport. A consumer shard sets Slab and SlabDevice; a
// producer sets Devices.
type Config struct {
	Slab       slab.Memory
	SlabDevice gpu.Device
	// Devices opens the device a source lives on; the mapping of a shard's
	// slab is opened in that device's context.
	Devices gpu.Devices
	// HostOrdinal is the device whose context copies host sources (a
	// producer whose outputs are in host memory); 0 by default.
	HostOrdinal int
	DialTimeout time.Duration
	// MaxConns caps the producer connections the shard's socket holds at
	// once (max_data_conns); zero means DefaultMaxConns.
	MaxConns int
	Logger   *slog.Logger
}

func (c Config) withDefaults() Config {
	defaults.Positive(&c.DialTimeout, DefaultDialTimeout)
	defaults.Positive(&c.MaxConns, DefaultMaxConns)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.Devices = gpu.Configured(c.Devices, "cuda_ipc")
	return c
}

// Transport is the CUDA IPC data plane.
type Transport struct {
	cfg Config
}

var _ transport.Transport = (*Transport)(nil)

// New returns the transport; zero fields take defaults.
func New(cfg Config) *Transport { return &Transport{cfg: cfg.withDefaults()} }

// Name implements transport.Transport.
func (t *Transport) Name() string { return Name }

// Listen exports the slab once and greets producers on a new abstract
// Unix socket; addr only names the shard's other planes and is not used.
// The receiver is a transport.Direct: the shard that owns sink admits
// each writer per region at its grant, since no write passes through the
// receiver. When sink is a transport.RemoteSink, each producer gets a
// ready-word region and its items complete in-band (words.go).
func (t *Transport) Listen(_ string, sink transport.Sink) (transport.Receiver, error) {
	if t.cfg.SlabDevice == nil {
		return nil, errors.New("cudaipc: listen needs a slab in GPU memory")
	}
	return t.listen(sink)
}

// NewWriter returns a writer with its own connections and mappings.
func (t *Transport) NewWriter() transport.Writer { return t.newWriter() }
