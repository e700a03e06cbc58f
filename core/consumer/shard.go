package consumer

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/due"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Options carries what the caller chooses beyond the settings.
type Options struct {
	// Transport is the data plane to listen on; it must match cfg.Transport.
	Transport transport.Transport
	Log       *slog.Logger
	// Tokens defaults to crypto/rand.
	Tokens ids.TokenSource
	// Links opens the control server and the event channel; when nil,
	// ZeroMQ with the security of auth_secret. The shard closes it.
	Links control.Links
}

// Shard is one consumer shard. Its methods are safe for concurrent use.
type Shard struct {
	cfg  config.Consumer
	log  *slog.Logger
	host string
	// cancelsLeft counts cancels by id that named a write grant and so
	// left it to its writer (reserve.ErrNeedsToken); under mu.
	cancelsLeft uint64
	// epoch names this incarnation of the shard: a restart on the same
	// control port gets a new one, and every reserve reply carries it, so
	// a producer never writes a grant to a process that did not issue it.
	epoch string

	mu    sync.Mutex // guards table; never held across I/O
	table *reserve.Table
	slab  *slab.Slab

	links  control.Links
	server control.Serving
	events control.Publisher
	recv   transport.Receiver
	// direct is recv's one-sided data plane, if it has one (recv itself,
	// or cuda_ipc next to TCP); remote holds the regions admitted for its
	// writers (see direct.go). Guarded by mu.
	direct transport.Direct
	remote map[ids.ResID]remoteWrite

	ticks     *due.Loop
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
	closeErr  error
	unwatch   func() // detaches the metrics probe
}

// Open starts a shard over mem, the receive slab the caller owns.
func Open(cfg config.Consumer, mem slab.Memory, opt Options) (s *Shard, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opt.Transport == nil {
		return nil, fmt.Errorf("consumer: no transport given for %q", cfg.Transport)
	}
	if mem.Len < slab.Align {
		return nil, fmt.Errorf("consumer: slab of %d bytes is smaller than one %d-byte block", mem.Len, slab.Align)
	}
	if opt.Log == nil {
		opt.Log = slog.Default()
	}
	if opt.Tokens == nil {
		opt.Tokens = ids.CryptoTokens
	}
	s = &Shard{
		cfg:   cfg,
		log:   opt.Log.With("shard", cfg.TPRank, "dp_rank", cfg.DPRank),
		host:  ids.HostIdentity(cfg.Host),
		epoch: newEpoch(),
		ticks: due.NewLoop(),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	s.slab = slab.NewSlab(mem)
	s.table = reserve.New(s.slab, reserve.Config{Lease: cfg.Lease(), MaxResidentBytes: cfg.MaxResidentBytes, CreditWindowBytes: cfg.CreditWindowBytes,
		CreditLease: min(reserve.DefaultCreditLease, cfg.Lease())}, opt.Tokens)

	s.links = opt.Links
	// The shard, not s: a failing return sets s to nil before this runs.
	opened := s
	defer func() {
		if err != nil {
			opened.shutdown()
		}
	}()
	if err := beyondLoopback(cfg); err != nil {
		return nil, err
	}
	links, sec, err := control.OpenLinks("consumer", cfg.LoadSecret, cfg.AllowUnauthenticated, opt.Links, control.WithUnixPath(cfg.ControlUnix))
	if err != nil {
		return nil, err
	}
	s.links = links
	if s.events, err = s.links.Publish(cfg.IP, s.log); err != nil {
		return nil, fmt.Errorf("consumer: event socket on %s: %w", cfg.IP, err)
	}
	dataAddr := net.JoinHostPort(cfg.IP, strconv.Itoa(cfg.DataPort))
	if s.recv, err = opt.Transport.Listen(dataAddr, sink{s}); err != nil {
		return nil, fmt.Errorf("consumer: %s data plane on %s: %w", opt.Transport.Name(), dataAddr, err)
	}
	s.direct, _ = transport.DirectOf(s.recv)
	s.remote = map[ids.ResID]remoteWrite{}
	bind := control.Endpoint(cfg.IP, cfg.ControlPort())
	if s.server, err = s.links.Serve(bind, handler{s}, s.log); err != nil {
		return nil, fmt.Errorf("consumer: control server on %s: %w", bind, err)
	}
	s.logSecurity(sec, bind)
	go s.ticker()
	s.unwatch = metrics.Watch(s.metricsName(), s.probe)
	s.log.Info("consumer shard listening", "control", s.server.Endpoint(), "data", s.recv.Addr(), "epoch", s.epoch,
		"events", s.events.Endpoint(), "slab_bytes", mem.Len, "transport", opt.Transport.Name())
	return s, nil
}

// newEpoch is the start time and 32 random bits: unique across restarts
// even when two incarnations start within the clock's resolution.
func newEpoch() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%x-%s", time.Now().UnixNano(), hex.EncodeToString(b[:]))
}

// beyondLoopback refuses a shard that other hosts can reach but that
// has no deployment secret: a per-user secret never leaves this host, and
// serving loopback peers of any uid without one is the poisoning the
// per-user secret exists to stop. allow_unauthenticated is the explicit
// way out.
func beyondLoopback(cfg config.Consumer) error {
	if cfg.Mode() == config.AuthConfigured || cfg.AllowUnauthenticated || control.IsLoopbackHost(cfg.IP) {
		return nil
	}
	return fmt.Errorf("consumer: %w: ec_ip %s is beyond loopback and there is no auth_secret: producers on other hosts could not "+
		"authenticate, and without a secret anybody could drive the shard; set the same auth_secret (or auth_secret_file; "+
		"ECMOONCAKE_SECRET for the vLLM connector) on every producer, consumer and scheduler, or allow_unauthenticated: true "+
		"to serve anybody who reaches it", config.ErrInvalid, cfg.IP)
}

// logSecurity says once, at startup, who can use the control plane: the
// operator of a shard that anybody can drive must hear it.
func (s *Shard) logSecurity(sec control.Security, bind string) {
	mode := s.cfg.Describe()
	switch {
	case s.cfg.Mode() == config.AuthPerUser:
		s.log.Info("control plane authenticated and encrypted (CURVE keys from the "+mode+"): this host's processes of this uid only",
			"control", bind, "auth", mode)
	case sec.Curve():
		s.log.Info("control plane authenticated and encrypted (CURVE keys from auth_secret)", "control", bind, "auth", mode)
	case control.IsLoopbackHost(s.cfg.IP):
		s.log.Warn("SECURITY: no secret (unauthenticated): every user of this host can reserve, complete and cancel transfers "+
			"on "+bind+"; set auth_secret, or leave every auth setting out to share a per-user secret", "control", bind, "auth", mode)
	default:
		s.log.Warn("SECURITY: allow_unauthenticated is set and there is no auth_secret: anybody who reaches "+bind+
			" can reserve, complete and cancel transfers, read events and learn data-plane tokens; set auth_secret",
			"control", bind, "auth", mode)
	}
}

// Info describes where the shard listens.
type Info struct {
	Control   string `json:"control"`
	Data      string `json:"data"`
	Events    string `json:"events"`
	Transport string `json:"transport"`
	Host      string `json:"host"`
	Epoch     string `json:"epoch"`
	TPRank    int    `json:"tp_rank"`
	TPSize    int    `json:"tp_size"`
	DPRank    int    `json:"dp_rank"`
	SlabBytes uint64 `json:"slab_bytes"`
}

// Info returns the shard's endpoints and identity.
func (s *Shard) Info() Info {
	return Info{
		Control: s.server.Endpoint(), Data: s.recv.Addr(), Events: s.events.Endpoint(),
		Transport: s.cfg.Transport, Host: s.host, Epoch: s.epoch, TPRank: s.cfg.TPRank, TPSize: s.cfg.TPSize,
		DPRank: s.cfg.DPRank, SlabBytes: s.slab.Size(),
	}
}

// Loaded is where an acquired item lies in the slab.
type Loaded struct {
	MMHash string `json:"mm_hash"`
	Offset uint64 `json:"offset"`
	NBytes uint64 `json:"nbytes"`
	Meta   string `json:"meta,omitempty"`
	Error  string `json:"error,omitempty"`
}

// Acquire pins ready items for the engine; each fails on its own.
func (s *Shard) Acquire(hashes []string) []Loaded {
	now := time.Now()
	out := make([]Loaded, len(hashes))
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, h := range hashes {
		out[i].MMHash = h
		off, n, err := s.table.Acquire(h, now)
		if err != nil {
			out[i].Error = err.Error()
			continue
		}
		out[i].Offset, out[i].NBytes = off, n
		out[i].Meta, _ = s.table.Meta(h)
	}
	return out
}

// Release unpins items the engine freed; each fails on its own.
func (s *Shard) Release(hashes []string) []error {
	now := time.Now()
	out := make([]error, len(hashes))
	s.mu.Lock()
	for i, h := range hashes {
		out[i] = s.table.Release(h, now)
	}
	s.flushLocked()
	s.mu.Unlock()
	return out
}

// Stats gathers the shard's counters.
type Stats struct {
	Table  reserve.Stats       `json:"table"`
	InUse  uint64              `json:"bytes_in_use"`
	Size   uint64              `json:"slab_bytes"`
	Server control.ServerStats `json:"control"`
	Data   transport.RecvStats `json:"data"`
	Events control.PubStats    `json:"events"`

	// Planes splits Data by data plane when the shard serves several.
	Planes map[string]transport.RecvStats `json:"data_planes,omitempty"`
	// CancelsLeftToWriter counts cancels by transfer id (no token) that
	// named a write in progress: the write goes on, and only its writer
	// may abandon it.
	CancelsLeftToWriter uint64 `json:"cancels_left_to_writer"`
}

// Stats returns a snapshot of the shard's counters.
func (s *Shard) Stats() Stats {
	s.mu.Lock()
	st := Stats{Table: s.table.Stats(), InUse: s.slab.InUse(), Size: s.slab.Size(), CancelsLeftToWriter: s.cancelsLeft}
	s.mu.Unlock()
	st.Server = s.server.Stats()
	st.Data = s.recv.Stats()
	if m, ok := s.recv.(interface {
		PlaneStats() map[string]transport.RecvStats
	}); ok {
		st.Planes = m.PlaneStats()
	}
	st.Events = s.events.Stats()
	return st
}

// Status reports where one transfer stands in the shard's table, live or
// remembered in its tombstones: what the status op answers a peer, for an
// operator or a test in the same process.
func (s *Shard) Status(transferID string) (reserve.StatusInfo, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.table.Status(transferID)
}

// Close stops the control server and the data plane and waits for their
// goroutines, so that the caller may free the slab afterwards.
func (s *Shard) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.shutdown() })
	return s.closeErr
}

func (s *Shard) shutdown() error {
	if s.unwatch != nil {
		s.unwatch()
	}
	var errs []error
	if s.server != nil {
		errs = append(errs, s.server.Close())
	}
	if s.recv != nil {
		errs = append(errs, s.recv.Close())
	}
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	if s.server != nil { // the ticker runs only once Open succeeded
		<-s.done
	}
	if s.events != nil {
		errs = append(errs, s.events.Close())
	}
	if s.links != nil {
		errs = append(errs, s.links.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("consumer: close: %w", err)
	}
	return nil
}

// ticker applies lease expiries when they fall due.
func (s *Shard) ticker() {
	defer close(s.done)
	s.ticks.Run(s.stop, func() (time.Time, bool) {
		s.safely("tick", func() {
			s.mu.Lock()
			s.table.Tick(time.Now())
			s.expireRemoteLocked(time.Now())
			s.sendEventsLocked()
			s.mu.Unlock()
		})
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.nextDeadlineLocked()
	})
}

// safely runs f and turns a panic into a log line: a broken invariant in
// one tick must not take the Python process down with it.
func (s *Shard) safely(what string, f func()) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("consumer: recovered panic", "in", what, "panic", r)
		}
	}()
	f()
}

// flushLocked sends the table's pending events and wakes the ticker when
// a call that changed the table moved the next deadline before the one it
// waits for (waking it on every call would cost every control op a
// goroutine hand-off). The caller holds mu, which is fine because neither
// step blocks.
func (s *Shard) flushLocked() {
	s.sendEventsLocked()
	if next, ok := s.nextDeadlineLocked(); ok {
		s.ticks.Due(next)
	}
}

// sendEventsLocked sends the table's pending events, in order, as one
// event message: a batch's readiness costs the scheduler one message and
// one step, not one per item. Order matters: a gone event must follow
// the ready events it ends and precede those of a later copy of the same
// content, because the scheduler reads it that way.
func (s *Shard) sendEventsLocked() {
	pending := s.table.Ready().Events
	if len(pending) == 0 {
		return
	}
	evs := make([]wire.Event, len(pending))
	for i, e := range pending {
		evs[i] = wire.Event{
			V: wire.Version, Shard: s.cfg.TPRank, TransferID: e.TransferID,
			MMHash: e.MMHash, Ready: e.Ready, NBytes: e.NBytes, Reason: e.Reason,
		}
		if e.Gone {
			evs[i].Kind = wire.EventGone
		} else if e.Ready {
			trace.Stamp(trace.Ready, e.MMHash)
		}
	}
	s.events.Send(evs...)
}
