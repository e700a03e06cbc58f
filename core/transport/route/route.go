package route

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Config wires a route.
type Config struct {
	Network transport.Transport
	// Local is the same-host transport; nil when this process cannot use
	// it, LocalOff saying why (for the log).
	Local    transport.Transport
	LocalOff string
	// Host is this process's host identity; a shard reporting the same one
	// is on this host.
	Host string
	// Overrides maps a shard's control endpoint, or a host identity, to
	// the transport to use for it.
	Overrides map[string]string
	Logger    *slog.Logger
}

// Transport routes each destination to one of two transports.
type Transport struct {
	cfg Config
	log *slog.Logger

	mu     sync.Mutex
	chosen map[string]string // peer -> transport name last logged
	broken map[string]bool   // destinations Local cannot reach
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Picker    = (*Transport)(nil)
)

// New returns a route.
func New(cfg Config) *Transport {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Transport{cfg: cfg, log: cfg.Logger.With("role", "route"), chosen: map[string]string{}, broken: map[string]bool{}}
}

// Name is the network transport's: the name the configuration knows.
func (t *Transport) Name() string { return t.cfg.Network.Name() }

// Listen listens on the network transport at addr and on the local one at
// addr's host with a free port.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	net0, err := t.cfg.Network.Listen(addr, sink)
	if err != nil {
		return nil, err
	}
	m := &multi{first: net0, names: []string{t.cfg.Network.Name()}, recvs: []transport.Receiver{net0}}
	if t.cfg.Local == nil {
		if t.cfg.LocalOff != "" {
			t.log.Info("no same-host data plane", "why", t.cfg.LocalOff)
		}
		return m, nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		_ = net0.Close()
		return nil, fmt.Errorf("route: listen %s: %w", addr, err)
	}
	local, err := t.cfg.Local.Listen(net.JoinHostPort(host, "0"), sink)
	if err != nil {
		t.log.Warn("same-host data plane unavailable; serving over the network only", "transport", t.cfg.Local.Name(), "cause", err)
		return m, nil
	}
	m.names = append(m.names, t.cfg.Local.Name())
	m.recvs = append(m.recvs, local)
	return m, nil
}

// Pick implements transport.Picker.
func (t *Transport) Pick(peer, host string, offered map[string]string) (string, error) {
	name, why, err := t.choose(peer, host, offered)
	if err != nil {
		return "", err
	}
	addr := offered[name]
	if addr == "" {
		return "", fmt.Errorf("route: shard at %s offers no %s data plane (it offers %v; %s)", peer, name, transport.Names(offered), why)
	}
	t.mu.Lock()
	logIt := t.chosen[peer] != name
	t.chosen[peer] = name
	t.mu.Unlock()
	if logIt {
		t.log.Info("data plane chosen", "peer", peer, "peer_host", host, "transport", name, "why", why)
	}
	return name + "://" + addr, nil
}

func (t *Transport) choose(peer, host string, offered map[string]string) (name, why string, err error) {
	network := t.cfg.Network.Name()
	for _, key := range []string{peer, host} {
		o, ok := t.cfg.Overrides[key]
		if !ok {
			continue
		}
		switch {
		case o == network:
		case t.cfg.Local != nil && o == t.cfg.Local.Name():
		default:
			reason := "no such transport here"
			if t.cfg.LocalOff != "" {
				reason = t.cfg.LocalOff
			}
			return "", "", fmt.Errorf("route: transport %q configured for %s is not available in this process: %s", o, key, reason)
		}
		return o, "configured for " + key, nil
	}
	switch {
	case host != t.cfg.Host:
		return network, fmt.Sprintf("other host (this one is %q)", t.cfg.Host), nil
	case t.cfg.Local == nil:
		return network, "same host, but " + t.cfg.LocalOff, nil
	case offered[t.cfg.Local.Name()] == "":
		return network, "same host, but the shard offers no " + t.cfg.Local.Name() + " (its slab is not in GPU memory?)", nil
	}
	local := t.cfg.Local.Name()
	t.mu.Lock()
	broken := t.broken[local+"://"+offered[local]]
	t.mu.Unlock()
	if broken {
		return network, "same host, but " + local + " could not reach this shard", nil
	}
	return local, "same host", nil
}

// NewWriter implements transport.Transport.
func (t *Transport) NewWriter() transport.Writer {
	return &writer{t: t, writers: map[string]transport.Writer{}}
}

type writer struct {
	t       *Transport
	mu      sync.Mutex
	closed  bool
	writers map[string]transport.Writer
}

// split parses a destination from Pick; one without a scheme is the
// network transport's address.
func (w *writer) split(dest string) (string, string) {
	if name, addr, ok := strings.Cut(dest, "://"); ok {
		return name, addr
	}
	return w.t.cfg.Network.Name(), dest
}

func (w *writer) writer(name string) (transport.Writer, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, transport.ErrClosed
	}
	if tw := w.writers[name]; tw != nil {
		return tw, nil
	}
	var tr transport.Transport
	switch {
	case name == w.t.cfg.Network.Name():
		tr = w.t.cfg.Network
	case w.t.cfg.Local != nil && name == w.t.cfg.Local.Name():
		tr = w.t.cfg.Local
	default:
		return nil, fmt.Errorf("route: no %q transport in this process", name)
	}
	tw := tr.NewWriter()
	w.writers[name] = tw
	return tw, nil
}

// InBand implements transport.InBandWriter: as the plane dest names does.
func (w *writer) InBand(dest string) bool {
	name, addr := w.split(dest)
	tw, err := w.writer(name)
	return err == nil && transport.InBand(tw, addr)
}

// CanStart implements transport.Starter: as the plane dest names does.
func (w *writer) CanStart(dest string) bool {
	name, addr := w.split(dest)
	tw, err := w.writer(name)
	if err != nil {
		return false
	}
	st, ok := tw.(transport.Starter)
	return ok && st.CanStart(addr)
}

// Start implements transport.Starter for the planes that do; the others
// say not ok, and the caller calls Write.
func (w *writer) Start(ctx context.Context, dest string, items []transport.WriteItem) (func() []error, bool) {
	name, addr := w.split(dest)
	tw, err := w.writer(name)
	if err != nil {
		return nil, false
	}
	st, ok := tw.(transport.Starter)
	if !ok {
		return nil, false
	}
	finish, ok := st.Start(ctx, addr, items)
	if !ok {
		return nil, false
	}
	return func() []error { return w.noteUnsupported(name, dest, finish()) }, true
}

func (w *writer) Write(ctx context.Context, dest string, items []transport.WriteItem) []error {
	name, addr := w.split(dest)
	tw, err := w.writer(name)
	if err != nil {
		errs := make([]error, len(items))
		for i, it := range items {
			errs[i] = transport.ItemErr(name, addr, it.Res, it.Off, it.Off+it.Len(), err)
		}
		return errs
	}
	return w.noteUnsupported(name, dest, tw.Write(ctx, addr, items))
}

// noteUnsupported marks dest broken for the same-host plane when its
// write found that plane cannot reach the shard, and returns errs.
func (w *writer) noteUnsupported(name, dest string, errs []error) []error {
	if w.t.cfg.Local != nil && name == w.t.cfg.Local.Name() {
		for _, err := range errs {
			if errors.Is(err, transport.ErrUnsupported) {
				w.t.mu.Lock()
				first := !w.t.broken[dest]
				w.t.broken[dest] = true
				w.t.mu.Unlock()
				if first {
					w.t.log.Warn("same-host data plane cannot reach a shard; the network carries its next pushes", "dest", dest, "cause", err)
				}
				break
			}
		}
	}
	return errs
}

func (w *writer) Close() error {
	w.mu.Lock()
	w.closed = true
	ws := w.writers
	w.writers = map[string]transport.Writer{}
	w.mu.Unlock()
	var errs []error
	for _, tw := range ws {
		errs = append(errs, tw.Close())
	}
	return errors.Join(errs...)
}

// multi is a receiver over several data planes.
type multi struct {
	first transport.Receiver
	names []string
	recvs []transport.Receiver
}

var (
	_ transport.MultiReceiver = (*multi)(nil)
	_ transport.DirectPlaner  = (*multi)(nil)
)

// DirectPlane is the first one-sided plane (cuda_ipc, next to TCP): its
// regions' addresses go into every write grant. Every one-sided plane of a
// shard names a region by its address in the shard's slab, so a second
// one would name it the same.
func (m *multi) DirectPlane() transport.Direct {
	for _, r := range m.recvs {
		if d, ok := r.(transport.Direct); ok {
			return d
		}
	}
	return nil
}

func (m *multi) Addr() string { return m.first.Addr() }

func (m *multi) Addrs() map[string]string {
	out := make(map[string]string, len(m.recvs))
	for i, r := range m.recvs {
		out[m.names[i]] = r.Addr()
	}
	return out
}

// Stats adds up the data planes' counters.
func (m *multi) Stats() transport.RecvStats {
	var out transport.RecvStats
	out.Rejected = map[string]uint64{}
	out.Closed = map[string]uint64{}
	for _, r := range m.recvs {
		s := r.Stats()
		out.Frames += s.Frames
		out.Bytes += s.Bytes
		out.BadConns += s.BadConns
		out.Attached += s.Attached
		out.Completed += s.Completed
		for k, v := range s.Rejected {
			out.Rejected[k] += v
		}
		for k, v := range s.Closed {
			out.Closed[k] += v
		}
	}
	return out
}

// PlaneStats is each data plane's counters, by transport name.
func (m *multi) PlaneStats() map[string]transport.RecvStats {
	out := make(map[string]transport.RecvStats, len(m.recvs))
	for i, r := range m.recvs {
		out[m.names[i]] = r.Stats()
	}
	return out
}

func (m *multi) Close() error {
	var errs []error
	for _, r := range m.recvs {
		errs = append(errs, r.Close())
	}
	return errors.Join(errs...)
}
