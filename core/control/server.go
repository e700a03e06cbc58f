package control

import (
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"runtime/debug"
	"sync"

	zmq "github.com/pebbe/zmq4"

	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Handler answers decoded, version-checked requests of a known op. It is
// called on the server's goroutine, one request at a time: it must be fast
// and do no I/O, or every caller of the shard waits behind it. The server
// stamps the reply's version and id, so a handler need not.
type Handler interface {
	Handle(req wire.Request) wire.Reply
}

// PeerWatcher is a Handler that hears when a connection it served ended
// (peer as in Request.Peer): nothing more comes on it, and the process
// behind it may be dead. The Unix path tells it, from the connection's
// own goroutine, after the connection's last request was answered; a
// ZeroMQ peer's connections are libzmq's, and it is not told of them.
type PeerWatcher interface {
	PeerGone(peer string)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(req wire.Request) wire.Reply

// Handle calls f.
func (f HandlerFunc) Handle(req wire.Request) wire.Reply { return f(req) }

// ServerStats counts what a server answered.
type ServerStats struct {
	Served       uint64            // requests answered, successfully or not
	ServedUnix   uint64            `json:",omitempty"` // of Served, those over the Unix path (control_unix)
	Errors       map[string]uint64 // error replies by code
	SendFailures uint64            // replies libzmq refused (the caller is gone or not reading)
	// Refused counts peers turned away by the security handshake, by
	// reason (the labels of ecm_failures_total{component="control"}).
	Refused map[string]uint64 `json:",omitempty"`
	// Oversized counts messages over the whole-message cap (parts or
	// bytes), dropped unkept and answered too_large.
	Oversized uint64
	// HeldPeak is the most bytes the server kept of any one message; the
	// cap keeps it at most MaxMessageBytes.
	HeldPeak uint64
	// ConnsLive is the connections the socket holds, as its monitor last
	// told; ConnsEvicted the ones closed to keep them within the cap
	// (WithMaxConns).
	ConnsLive    int
	ConnsEvicted uint64
}

// MaxMessageBytes caps the bytes a server keeps of one multipart message.
const MaxMessageBytes = maxMessage

// ServerOption configures NewServer and NewEventPub.
type ServerOption func(*serverOptions)

type serverOptions struct {
	sec      Security
	maxConns int
	perPeer  int
}

// DefaultMaxConns caps the connections of one server socket: producers
// and a scheduler keep one each, so a thousand is far beyond a real
// deployment and far below a process's descriptors.
const DefaultMaxConns = 1024

// WithMaxConns caps the socket's connections (DefaultMaxConns when not
// given or not positive).
func WithMaxConns(n int) ServerOption {
	return func(o *serverOptions) { o.maxConns = n }
}

// DefaultMaxConnsPerPeer caps the connections of one peer address to one
// server socket, so that one address cannot take every place of the cap.
// Same-host peers share 127.0.0.1 (or ::1), so it is also the most
// producer processes of one host a shard serves over TCP; a quarter of
// DefaultMaxConns is far beyond that.
const DefaultMaxConnsPerPeer = DefaultMaxConns / 4

// WithMaxConnsPerPeer caps the connections of one peer address
// (DefaultMaxConnsPerPeer when not given or not positive, and never
// above the socket's cap).
func WithMaxConnsPerPeer(n int) ServerOption {
	return func(o *serverOptions) { o.perPeer = n }
}

// WithServerSecurity sets how the socket authenticates its peers; the
// default is the zero Security (no secret, protected mode).
func WithServerSecurity(sec Security) ServerOption {
	return func(o *serverOptions) { o.sec = sec }
}

func serverOpts(opts []ServerOption) serverOptions {
	var o serverOptions
	for _, f := range opts {
		f(&o)
	}
	if o.maxConns <= 0 {
		o.maxConns = DefaultMaxConns
	}
	if o.perPeer <= 0 {
		o.perPeer = DefaultMaxConnsPerPeer
	}
	o.perPeer = min(o.perPeer, o.maxConns)
	return o
}

// Server is a ROUTER socket that answers requests with a Handler.
type Server struct {
	*owner
	sock     *zmq.Socket // owner goroutine only, once NewServer returns
	guard    *guard
	h        Handler
	endpoint string

	counters serverCounters
}

// NewServer binds a ROUTER to bind ("tcp://host:port"; host "*" for every
// interface, port 0 for any free port) and serves it on a new goroutine
// until Close. A hostname is bound on every address it resolves to, so that
// a client resolving it either way reaches the server. Peers are admitted
// as WithServerSecurity says.
func NewServer(zctx *zmq.Context, bind string, h Handler, log *slog.Logger, opts ...ServerOption) (*Server, error) {
	host, port, err := SplitEndpoint(bind)
	if err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("control: new server: nil handler")
	}
	sock, g, err := newGuardedSocket(zctx, zmq.ROUTER, serverOpts(opts), host, log)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Server, error) {
		closeGuarded(sock, g)
		return nil, err
	}
	endpoint, err := bindAll(sock, host, port, log)
	if err != nil {
		return fail(err)
	}
	if err := g.bound(endpoint); err != nil {
		return fail(err)
	}
	s := &Server{
		sock:     sock,
		guard:    g,
		h:        h,
		endpoint: endpoint,
	}
	if s.owner, err = newOwner(log, "server "+endpoint, pollItem{sock: sock, serve: s.serve}, g.monitor()); err != nil {
		return fail(err)
	}
	s.onExit = g.close
	s.start()
	return s, nil
}

// newGuardedSocket opens a server socket with its guard, ready to bind.
func newGuardedSocket(zctx *zmq.Context, t zmq.Type, o serverOptions, bindHost string, log *slog.Logger) (*zmq.Socket, *guard, error) {
	sock, err := newSocket(zctx, t)
	if err != nil {
		return nil, nil, err
	}
	g, err := newGuard(zctx, sock, o.sec, bindHost, o.maxConns, o.perPeer, log)
	if err != nil {
		sock.Close()
		return nil, nil, err
	}
	return sock, g, nil
}

// closeGuarded undoes newGuardedSocket for a socket no goroutine owns yet.
func closeGuarded(sock *zmq.Socket, g *guard) {
	sock.Close()
	g.mon.Close()
	g.close()
}

// bindAll binds sock to every address of host and returns the endpoint
// with the port actually bound: the host as given, or for the wildcard the
// address libzmq reports.
func bindAll(sock *zmq.Socket, host string, port int, log *slog.Logger) (string, error) {
	addrs := resolve(host)
	first := Endpoint(addrs[0], port)
	if err := sock.Bind(first); err != nil {
		return "", fmt.Errorf("control: bind %s: %w", first, err)
	}
	last, err := sock.GetLastEndpoint()
	if err != nil {
		return "", fmt.Errorf("control: bind %s: %w", first, err)
	}
	_, bound, err := SplitEndpoint(last)
	if err != nil {
		return "", err
	}
	for _, a := range addrs[1:] {
		// Best effort: a name may list an address family the host lacks.
		if err := sock.Bind(Endpoint(a, bound)); err != nil && log != nil {
			log.Warn("control: bind extra address failed", "host", host, "addr", a, "err", err)
		}
	}
	if host == "*" {
		return unmapped(last), nil
	}
	return Endpoint(host, bound), nil
}

// Endpoint is where the server listens, with the port it actually got.
func (s *Server) Endpoint() string { return s.endpoint }

// Close stops the server and closes its socket. Idempotent.
func (s *Server) Close() error { s.stop(); return nil }

// Stats returns a snapshot of the counters.
func (s *Server) Stats() ServerStats {
	out := s.counters.snapshot()
	if r := s.guard.stats(); len(r) > 0 {
		out.Refused = r
	}
	out.ConnsLive, out.ConnsEvicted = s.guard.connStats()
	return out
}

// serve answers the requests waiting. Owner only.
func (s *Server) serve() error {
	return recvEach(s.sock, func(m capped) bool { s.serveOne(m); return true })
}

// serveOne answers one message. parts[0] is the caller's identity, added
// by ROUTER; our protocol puts exactly one frame after it.
func (s *Server) serveOne(m capped) {
	parts := m.parts
	s.counters.held(m.held)
	var rep wire.Reply
	switch {
	case m.over:
		s.counters.oversized()
		metrics.Failed("control", "message_too_large")
		s.log.Debug("control: dropped a message over the whole-message cap", "max_parts", maxParts, "max_bytes", maxMessage)
		rep = wire.ErrReply(0, wire.CodeTooLarge, fmt.Sprintf("message over the cap of %d parts and %d bytes; want one frame per message", maxParts-1, maxMessage))
	case len(parts) < 2:
		return
	case len(parts) != 2:
		req, _ := wire.DecodeRequest(parts[len(parts)-1])
		rep = wire.ErrReply(req.ID, wire.CodeBadRequest, fmt.Sprintf("want one frame per message, got %d", len(parts)-1))
	default:
		// ROUTER names each connection by a routing id of its own,
		// unique among its live connections (no handover), and every
		// message on it passed the connection's CURVE handshake.
		rep = answer(s.h, s.log, "zmq:"+hex.EncodeToString(parts[0]), parts[1])
	}
	rep, frame, ok := s.counters.reply(rep, s.log)
	if !ok {
		return
	}
	if _, err := s.sock.SendMessageDontwait(parts[0], frame); err != nil {
		s.counters.sendFailed()
		s.log.Debug("control: reply not sent", "id", rep.ID, "err", err)
	}
}

// answer decodes one request frame that came on the connection peer and
// answers it with h: an undecodable request gets the error of its
// decoding, and a panic in h answers CodeInternal, since one bad request
// must not take down a shard.
func answer(h Handler, log *slog.Logger, peer string, frame []byte) (rep wire.Reply) {
	req, err := wire.DecodeRequest(frame)
	req.Peer = peer
	if err != nil {
		log.Debug("control: refused request", "id", req.ID, "err", err)
		return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
	}
	defer func() {
		if r := recover(); r != nil {
			log.Error("control: handler panicked", "op", req.Op, "id", req.ID, "panic", r, "stack", string(debug.Stack()))
			rep = wire.ErrReply(req.ID, wire.CodeInternal, fmt.Sprintf("%s handler failed", req.Op))
		}
	}()
	rep = h.Handle(req)
	rep.V, rep.ID = wire.Version, req.ID
	return rep
}

// encodeAnswer encodes rep or, when it cannot be (a body over the cap),
// an error reply in its place, and returns the reply it encoded; an error
// says that not even the error reply could be.
func encodeAnswer(rep wire.Reply) (wire.Reply, []byte, error) {
	frame, err := wire.EncodeReply(rep)
	if err == nil {
		return rep, frame, nil
	}
	code := wire.CodeInternal
	if errors.Is(err, wire.ErrTooLarge) {
		code = wire.CodeTooLarge
	}
	rep = wire.ErrReply(rep.ID, code, err.Error())
	frame, err = wire.EncodeReply(rep)
	return rep, frame, err
}

// serverCounters are the counters of a server, ZeroMQ's or the Unix
// path's, under a lock of their own: both answer a frame the same way.
type serverCounters struct {
	mu    sync.Mutex
	stats ServerStats
}

// held notes the bytes kept of one message.
func (c *serverCounters) held(n int) {
	c.mu.Lock()
	c.stats.HeldPeak = max(c.stats.HeldPeak, uint64(n))
	c.mu.Unlock()
}

func (c *serverCounters) oversized() {
	c.mu.Lock()
	c.stats.Oversized++
	c.mu.Unlock()
}

func (c *serverCounters) sendFailed() {
	c.mu.Lock()
	c.stats.SendFailures++
	c.mu.Unlock()
}

// reply encodes rep as encodeAnswer does and counts the reply encoded. It
// is counted before it is sent, so that a caller holding the reply sees it
// in Stats. false (logged): not even an error reply could be encoded.
func (c *serverCounters) reply(rep wire.Reply, log *slog.Logger) (wire.Reply, []byte, bool) {
	rep, frame, err := encodeAnswer(rep)
	if err != nil {
		if log == nil {
			log = slog.Default()
		}
		log.Error("control: cannot encode error reply", "id", rep.ID, "err", err)
		return rep, nil, false
	}
	c.mu.Lock()
	c.stats.Served++
	if rep.Err != nil {
		if c.stats.Errors == nil {
			c.stats.Errors = map[string]uint64{}
		}
		c.stats.Errors[rep.Err.Code]++
	}
	c.mu.Unlock()
	return rep, frame, true
}

// snapshot copies the counters; Errors is never nil.
func (c *serverCounters) snapshot() ServerStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.stats
	out.Errors = maps.Clone(c.stats.Errors)
	if out.Errors == nil {
		out.Errors = map[string]uint64{}
	}
	return out
}

// unmapped rewrites an IPv4-mapped IPv6 endpoint (what libzmq reports for
// an IPv4 bind once IPv6 is on) in plain IPv4 form.
func unmapped(ep string) string {
	host, port, err := SplitEndpoint(ep)
	if err != nil {
		return ep
	}
	if ip := net.ParseIP(host); ip != nil && ip.To4() != nil {
		return Endpoint(ip.To4().String(), port)
	}
	return ep
}
