package tcp

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Defaults applied by NewTCP to zero fields of TCPConfig.
const (
	DefaultConns       = 4
	DefaultChunkSize   = 8 << 20
	DefaultDialTimeout = 5 * time.Second
	// DefaultMaxConns is far above what the producers of one deployment
	// hold (tcp_conns per producer process), far below a process's
	// descriptor limit.
	DefaultMaxConns = 256
	// DefaultIdleTimeout outlasts the gaps between requests of a busy
	// deployment, so pools stay warm, and frees a slot held for nothing.
	DefaultIdleTimeout = 5 * time.Minute
	// DefaultFrameTimeout is ample for a MaxFrame frame over a 1 Gb/s link
	// and well inside the default lease.
	DefaultFrameTimeout = 30 * time.Second
	// DefaultHandshakeTimeout is many round trips of any network a
	// deployment spans, and short enough that a peer that never proves
	// itself holds a slot for little time.
	DefaultHandshakeTimeout = time.Second
	// DefaultMaxUnproven bounds connections still in their handshake, a
	// budget apart from MaxConns so that they never take a proven
	// connection's slot.
	DefaultMaxUnproven = 256
)

// TCPConfig tunes the native TCP transport. Zero values take the defaults.
type TCPConfig struct {
	// Conns is the number of persistent connections per destination; a
	// large item is split so that its chunks travel over all of them at
	// once.
	Conns int
	// ChunkSize is the largest frame payload; items above it are split.
	// Capped at MaxFrame.
	ChunkSize int
	// DialTimeout bounds one connection attempt (a ctx deadline that comes
	// sooner wins).
	DialTimeout time.Duration
	// SocketBuffer, when positive, sets SO_SNDBUF and SO_RCVBUF on every
	// connection; zero leaves the kernel's autotuning alone.
	SocketBuffer int
	// MaxConns caps the connections a receiver serves at once. At the cap
	// a new connection takes the place of the one idle longest; when every
	// one has a frame in flight, the new one is closed at once. Zero means
	// DefaultMaxConns.
	MaxConns int
	// IdleTimeout closes a receiver's connection that has had no frame in
	// flight for this long, after a goodbye that lets the writer resend
	// on a new connection what it sent meanwhile. Zero means
	// DefaultIdleTimeout.
	IdleTimeout time.Duration
	// FrameTimeout bounds one frame at the receiver, from its first header
	// byte to its ack: a writer that stalls mid-frame loses the connection
	// and its frame ends torn, so that the region can be reclaimed. Keep
	// it within the consumer's lease. Zero means DefaultFrameTimeout.
	FrameTimeout time.Duration
	// Secret is the deployment secret (auth_secret). With one, a receiver
	// admits only connections whose preamble carries a MAC of its fresh
	// challenge keyed by it; without one, only connections whose first
	// frame carries the write token of a live grant. Both ends of a
	// deployment set the same.
	Secret Secret
	// HandshakeTimeout bounds a new connection's proof at the receiver
	// (the challenge answered and, without a secret, the first header
	// accepted); zero means DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// MaxUnproven caps the connections a receiver holds that have not
	// proven themselves yet; at the cap a newcomer takes the place of the
	// oldest of them. Zero means DefaultMaxUnproven.
	MaxUnproven int
	// Logger receives rate-limited warnings about refused frames and bad
	// peers. Nil means slog.Default().
	Logger *slog.Logger
}

// TCP is the embedded default transport: host memory over plain TCP
// connections, with no copy on either side beyond the kernel's.
type TCP struct {
	cfg TCPConfig
}

// NewTCP returns a TCP transport with cfg's zero fields defaulted.
func NewTCP(cfg TCPConfig) *TCP {
	defaults.Positive(&cfg.Conns, DefaultConns)
	defaults.Positive(&cfg.ChunkSize, DefaultChunkSize)
	cfg.ChunkSize = min(cfg.ChunkSize, MaxFrame)
	defaults.Positive(&cfg.DialTimeout, DefaultDialTimeout)
	defaults.Positive(&cfg.MaxConns, DefaultMaxConns)
	defaults.Positive(&cfg.IdleTimeout, DefaultIdleTimeout)
	defaults.Positive(&cfg.FrameTimeout, DefaultFrameTimeout)
	defaults.Positive(&cfg.HandshakeTimeout, DefaultHandshakeTimeout)
	defaults.Positive(&cfg.MaxUnproven, DefaultMaxUnproven)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &TCP{cfg: cfg}
}

// Config is the settings t runs with, defaults applied.
func (t *TCP) Config() TCPConfig { return t.cfg }

// Name implements Transport.
func (t *TCP) Name() string { return "tcp" }

// Listen starts a receiver on addr ("host:port"; port 0 picks one; IPv4,
// bracketed IPv6 and host names all work) that feeds sink.
func (t *TCP) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	if sink == nil {
		return nil, errors.New("transport: tcp listen: nil sink")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("transport: tcp listen %s: %w", addr, err)
	}
	r := newTCPReceiver(ln, sink, t.cfg)
	return r, nil
}

// NewWriter returns a writer with its own connection pools.
func (t *TCP) NewWriter() transport.Writer { return newTCPWriter(t.cfg) }

// tuneConn applies the socket settings both ends share.
func tuneConn(c net.Conn, cfg TCPConfig) {
	tc, ok := c.(*net.TCPConn)
	if !ok || cfg.SocketBuffer <= 0 {
		return
	}
	// Best effort: the kernel clamps to its limits and a refusal only costs
	// throughput, never correctness.
	_ = tc.SetReadBuffer(cfg.SocketBuffer)
	_ = tc.SetWriteBuffer(cfg.SocketBuffer)
}
