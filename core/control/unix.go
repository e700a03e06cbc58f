package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/internal/peercred"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Bounds of the Unix control path.
const (
	// UnixMaxConns caps the connections one Unix server holds at once,
	// and UnixMaxConnsPerUID those of one peer uid (SO_PEERCRED), so that
	// of the uids admitted (this process's and root's) one cannot take
	// every place. A client holds one connection per server.
	UnixMaxConns       = 64
	UnixMaxConnsPerUID = UnixMaxConns / 2
	// unixHandshakeTimeout bounds the admission of one connection.
	unixHandshakeTimeout = 2 * time.Second
	// unixClientIdle: a client closes a connection idle this long, before
	// the server would (unixServerIdle), so that a server never closes a
	// connection under a request on its way.
	unixClientIdle = 60 * time.Second
	unixServerIdle = 2 * unixClientIdle
	// unixWriteTimeout bounds a reply's write: a client that does not read
	// loses its connection, not the server's time.
	unixWriteTimeout = 5 * time.Second
	// unixRetry is how long a client that could not reach the Unix path
	// uses ZeroMQ before it tries again.
	unixRetry = time.Second
)

// UnixName is the abstract Unix socket name of the control server that
// listens on the ZeroMQ endpoint ep: "@ecmooncake/control/host:port".
// Abstract names live in the network namespace and open no file, so a
// name that a peer gives cannot point this process at anything else.
func UnixName(ep string) (string, error) {
	target, err := concreteEndpoint("unix name of", ep)
	if err != nil {
		return "", err
	}
	return "@ecmooncake/control/" + strings.TrimPrefix(target, tcpScheme), nil
}

// isLocalHost reports whether host is an address of this network
// namespace: a TCP connection to it stays here, so a Unix name derived
// from it names the same listener.
func isLocalHost(host string) bool {
	if IsLoopbackHost(host) {
		return true
	}
	ip := net.ParseIP(strings.Split(host, "%")[0])
	if ip == nil {
		return false
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
			return true
		}
	}
	return false
}

// unixOptions are the test seams of the Unix path.
type unixOptions struct {
	allowed   func(uid uint32) bool // the uid rule; sameUser unless a test says
	uidOf     func(*net.UnixConn) (uint32, error)
	maxConns  int
	maxPerUID int
	// writeTimeout bounds one write of events to a subscriber.
	writeTimeout time.Duration
	// eventQueue bounds the events held for one subscriber connection.
	eventQueue int
	// handshakeTimeout bounds a server's admission of one connection.
	handshakeTimeout time.Duration
}

func defaultUnixOptions() unixOptions {
	return unixOptions{allowed: sameUser, uidOf: peercred.UID, maxConns: UnixMaxConns, maxPerUID: UnixMaxConnsPerUID,
		writeTimeout: unixWriteTimeout, eventQueue: EventQueue, handshakeTimeout: unixHandshakeTimeout}
}

// serialHandler calls h one request at a time for every server sharing
// it, keeping Handler's contract when ZeroMQ and Unix serve one shard.
type serialHandler struct {
	mu sync.Mutex
	h  Handler
}

func (s *serialHandler) Handle(req wire.Request) wire.Reply {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.h.Handle(req)
}

// PeerGone tells h, one call at a time as for Handle, when it watches.
func (s *serialHandler) PeerGone(peer string) {
	if w, ok := s.h.(PeerWatcher); ok {
		s.mu.Lock()
		defer s.mu.Unlock()
		w.PeerGone(peer)
	}
}

// UnixServer answers the control requests of same-host peers on an
// abstract Unix socket, read by Go's network poller: one goroutine per
// connection, requests answered in their order, the handler called one
// request at a time. Its gate (unixgate.go) admits the connections.
type UnixServer struct {
	gate *unixGate
	h    Handler
	log  *slog.Logger

	counters serverCounters // but Refused, the gate's
	conns    atomic.Uint64  // connections served, to name each (Request.Peer)
}

// ListenUnix serves h on the abstract socket name (UnixName), admitting
// peers of this uid (or root) that hold sec's secret.
func ListenUnix(name string, h Handler, sec Security, log *slog.Logger) (*UnixServer, error) {
	return listenUnix(name, h, sec, log, defaultUnixOptions())
}

func listenUnix(name string, h Handler, sec Security, log *slog.Logger, opt unixOptions) (*UnixServer, error) {
	if err := abstractName("unix listen", name); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("control: unix listen: nil handler")
	}
	if log == nil {
		log = slog.Default()
	}
	s := &UnixServer{h: h, log: log}
	g, err := listenUnixGate(name, "unix peer", sec, log, opt.withDefaults(), s.serveConn)
	if err != nil {
		return nil, fmt.Errorf("control: unix listen %s: %w", name, err)
	}
	s.gate = g
	return s, nil
}

// Endpoint is the abstract name served.
func (s *UnixServer) Endpoint() string { return s.gate.name }

// Stats returns a snapshot of the counters.
func (s *UnixServer) Stats() ServerStats {
	out := s.counters.snapshot()
	out.Refused = s.gate.refusals()
	return out
}

// Close stops accepting, closes every connection and waits for their
// goroutines. Idempotent.
func (s *UnixServer) Close() error {
	s.gate.close()
	return nil
}

// serveConn answers the requests of one admitted connection.
func (s *UnixServer) serveConn(c *net.UnixConn, uid uint32) {
	// The kernel vouched for the uid at accept; the connection's number
	// tells two connections of one uid apart.
	peer := fmt.Sprintf("unix:uid=%d:conn=%d", uid, s.conns.Add(1))
	if w, ok := s.h.(PeerWatcher); ok {
		defer w.PeerGone(peer)
	}
	var out []byte
	for {
		_ = c.SetReadDeadline(time.Now().Add(unixServerIdle))
		frame, err := readUnixFrame(c)
		if err != nil {
			if errors.Is(err, errUnixFrame) {
				s.counters.oversized()
				metrics.Failed("control", "message_too_large")
				s.log.Warn("control: unix peer sent a frame over the cap; closing", "name", s.gate.name, "err", err)
			}
			return
		}
		s.counters.held(len(frame))
		rep, enc, ok := s.counters.reply(answer(s.h, s.log, peer, frame), s.log)
		if !ok {
			return
		}
		out, _ = appendUnixFrame(out[:0], enc)
		_ = c.SetWriteDeadline(time.Now().Add(unixWriteTimeout))
		if _, err := c.Write(out); err != nil {
			s.counters.sendFailed()
			s.log.Debug("control: unix reply not sent", "id", rep.ID, "err", err)
			return
		}
	}
}

// UnixClient is a caller over one abstract Unix socket. Calls pipeline on
// one connection, matched to replies by id; a lost connection fails the
// calls on it and the next call dials again.
type UnixClient struct {
	name string
	key  []byte
	opt  unixOptions
	log  *slog.Logger

	nextID     atomic.Uint64
	roundTrips atomic.Uint64
	late       atomic.Uint64
	bad        atomic.Uint64

	dialMu sync.Mutex // one dial at a time
	mu     sync.Mutex
	conn   *unixConn
	closed bool
}

type unixConn struct {
	c     *net.UnixConn
	wmu   sync.Mutex // one frame written at a time
	calls callTable  // closed once the connection is lost
	last  atomic.Int64
	done  chan struct{}
}

// errNotSent marks a call that never reached the server: the caller may
// send it another way.
var errNotSent = errors.New("not sent")

// errUnixUnreachable: nothing listens on the name, or it cannot be dialled.
var errUnixUnreachable = errors.New("unix name unreachable")

// DialUnix returns a client of the abstract socket name. Like Dial it does
// not wait for the server: the first call connects.
func DialUnix(name string, sec Security, log *slog.Logger) (*UnixClient, error) {
	return dialUnix(name, sec, log, defaultUnixOptions())
}

func dialUnix(name string, sec Security, log *slog.Logger, opt unixOptions) (*UnixClient, error) {
	if err := abstractName("unix dial", name); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	return &UnixClient{name: name, key: unixKey(sec), opt: opt, log: log}, nil
}

// Endpoint is the abstract name dialled.
func (u *UnixClient) Endpoint() string { return u.name }

// Stats returns the counters.
func (u *UnixClient) Stats() ClientStats {
	return ClientStats{RoundTrips: u.roundTrips.Load(), LateReplies: u.late.Load(), BadReplies: u.bad.Load()}
}

// Close fails calls in flight with ErrClosed. Idempotent.
func (u *UnixClient) Close() error {
	u.mu.Lock()
	u.closed = true
	cn := u.conn
	u.conn = nil
	u.mu.Unlock()
	if cn != nil {
		cn.lose(ErrClosed)
		<-cn.done
	}
	return nil
}

// Call has Caller's contract.
func (u *UnixClient) Call(ctx context.Context, op wire.Op, body, out any) error {
	ctx, cancel := callContext(ctx, DefaultCallTimeout)
	defer cancel()
	return u.call(ctx, op, body, out)
}

func (u *UnixClient) fail(op wire.Op, id uint64, err error) error {
	return fmt.Errorf("control: %s #%d to %s: %w", op, id, u.name, err)
}

// call sends one request; an error wrapping errNotSent never reached the
// server. ctx has a deadline.
func (u *UnixClient) call(ctx context.Context, op wire.Op, body, out any) error {
	id := u.nextID.Add(1)
	enc, err := requestFrame(id, op, body)
	if err != nil {
		return u.fail(op, id, err)
	}
	frame, err := appendUnixFrame(nil, enc)
	if err != nil {
		return u.fail(op, id, err)
	}
	cn, err := u.connected(ctx)
	if err != nil {
		return u.fail(op, id, fmt.Errorf("%w: %w", errNotSent, err))
	}
	ch, err := cn.calls.add(id)
	if err != nil {
		return u.fail(op, id, fmt.Errorf("%w: %w", errNotSent, err))
	}
	defer cn.calls.forget(id)

	dl, _ := ctx.Deadline()
	cn.wmu.Lock()
	_ = cn.c.SetWriteDeadline(dl)
	_, err = cn.c.Write(frame)
	cn.wmu.Unlock()
	cn.last.Store(time.Now().UnixNano())
	if err != nil {
		// Maybe part of it went: never resend it elsewhere.
		cn.lose(fmt.Errorf("write: %w", err))
		return u.fail(op, id, fmt.Errorf("unix connection lost: %w", err))
	}
	var res result
	select {
	case res = <-ch:
	case <-ctx.Done():
		return u.fail(op, id, ctx.Err())
	}
	if err := res.into(out); err != nil {
		return u.fail(op, id, err)
	}
	return nil
}

// connected returns the live connection, dialling and admitting one when
// there is none or the one there has idled past unixClientIdle.
func (u *UnixClient) connected(ctx context.Context) (*unixConn, error) {
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		return nil, ErrClosed
	}
	cn := u.conn
	u.mu.Unlock()
	if cn != nil && cn.alive() {
		return cn, nil
	}
	u.dialMu.Lock()
	defer u.dialMu.Unlock()
	u.mu.Lock()
	cn = u.conn
	u.mu.Unlock()
	if cn != nil && cn.alive() {
		return cn, nil
	}
	if cn != nil {
		cn.lose(errors.New("idle"))
	}
	c, err := dialAdmitted(ctx, u.name, u.key, u.opt.allowed)
	if err != nil {
		return nil, err
	}
	cn = &unixConn{c: c, calls: newCallTable(), done: make(chan struct{})}
	cn.last.Store(time.Now().UnixNano())
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		_ = c.Close()
		return nil, ErrClosed
	}
	u.conn = cn
	u.mu.Unlock()
	go u.read(cn)
	return cn, nil
}

// dialAdmitted connects to the server on the abstract name and passes
// its admission (clientHandshake), within ctx and unixHandshakeTimeout.
// An error wrapping errUnixUnreachable: nothing could be dialled.
func dialAdmitted(ctx context.Context, name string, key []byte, allowed func(uint32) bool) (*net.UnixConn, error) {
	dl := time.Now().Add(unixHandshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	d := net.Dialer{Deadline: dl}
	raw, err := d.DialContext(ctx, "unix", name)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUnixUnreachable, err)
	}
	c := raw.(*net.UnixConn)
	_ = c.SetDeadline(dl)
	if err := clientHandshake(c, key, allowed); err != nil {
		_ = c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// alive: not lost, and not idle long enough for the server to drop it.
func (cn *unixConn) alive() bool {
	return !cn.calls.isClosed() && time.Since(time.Unix(0, cn.last.Load())) < unixClientIdle
}

// lose closes the connection once and fails every call waiting on it.
func (cn *unixConn) lose(err error) {
	if cn.calls.close(err, fmt.Errorf("unix connection lost: %w", err)) {
		_ = cn.c.Close()
	}
}

// read matches replies to calls until the connection is lost.
func (u *UnixClient) read(cn *unixConn) {
	defer close(cn.done)
	for {
		// The idle bound of a connection nobody uses; calls bound their own waits.
		_ = cn.c.SetReadDeadline(time.Now().Add(unixServerIdle))
		frame, err := readUnixFrame(cn.c)
		if err != nil {
			cn.lose(err)
			return
		}
		rep, err := wire.DecodeReply(frame)
		if err != nil {
			u.bad.Add(1)
			u.log.Warn("control: undecodable unix reply", "name", u.name, "id", rep.ID, "err", err)
			if rep.ID != 0 {
				cn.deliver(rep.ID, result{err: fmt.Errorf("undecodable reply: %w", err)}, nil)
			}
			continue
		}
		if !cn.deliver(rep.ID, result{rep: rep}, &u.roundTrips) {
			u.late.Add(1)
		}
	}
}

func (cn *unixConn) deliver(id uint64, r result, trips *atomic.Uint64) bool {
	return cn.calls.deliver(id, r, trips)
}
