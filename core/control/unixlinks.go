package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Unix is the Links of a process whose same-host peers skip libzmq: every
// server it opens also listens on the abstract Unix name of its endpoint
// (UnixName), and every caller it dials to an address of this host calls
// over that name, falling back to ZeroMQ, counted and logged, when the
// name cannot be reached or refuses it. Readiness events take the same
// path (unixevents.go): a publisher also listens on its endpoint's Unix
// name, and a subscriber follows a same-host publisher there. Peers on
// other hosts go over the ZeroMQ links it wraps, CURVE as ever.
type Unix struct {
	*ZMQ
	sec Security
	opt unixOptions

	mu        sync.Mutex
	fallbacks map[string]uint64
}

var (
	_ Links          = (*Unix)(nil)
	_ RefusalCounter = (*Unix)(nil)
	_ Caller         = (*UnixClient)(nil)
	_ Serving        = (*UnixServer)(nil)
	_ Caller         = (*unixCaller)(nil)
	_ Serving        = (*dualServer)(nil)
)

// Publish binds the ZeroMQ event publisher and listens on its Unix name;
// a name that cannot be had leaves events on ZeroMQ alone, logged and
// counted.
func (u *Unix) Publish(host string, log *slog.Logger) (Publisher, error) {
	if log == nil {
		log = slog.Default()
	}
	zp, err := NewEventPub(u.zctx, host, log, WithServerSecurity(u.sec))
	if err != nil {
		return nil, err
	}
	up, ok := listenBeside(zp.Endpoint(), "these events; same-host schedulers", log, func(name string) (*UnixEventPub, error) {
		return listenUnixEvents(name, zp, u.sec, log, u.opt)
	})
	if !ok {
		return zp, nil
	}
	return up, nil
}

// listenBeside opens, with listen, the Unix path on the name of the
// ZeroMQ endpoint ep. A failure is counted (unix_listen) and logged, and
// ok is false: the caller then serves over ZeroMQ alone, which who (what
// is served; who then uses ZeroMQ) names in the log.
func listenBeside[T any](ep, who string, log *slog.Logger, listen func(name string) (T, error)) (t T, ok bool) {
	name, err := UnixName(ep)
	if err == nil {
		t, err = listen(name)
	}
	if err != nil {
		metrics.Failed("control", "unix_listen")
		log.Warn("control: no unix path for "+who+" use ZeroMQ", "endpoint", ep, "err", err)
		return t, false
	}
	return t, true
}

// Subscribe opens the ZeroMQ event subscriber, which Unix subscriptions of
// same-host publishers join.
func (u *Unix) Subscribe(log *slog.Logger) (Subscriber, error) {
	zs, err := u.ZMQ.Subscribe(log)
	if err != nil {
		return nil, err
	}
	return newUnixEventSub(zs, u.sec, log, u.opt, func(cause string) { u.fellBack("events_" + cause) }), nil
}

// NewUnix opens ZeroMQ links secured by sec with the Unix path beside.
func NewUnix(sec Security) (*Unix, error) {
	z, err := NewZMQ(sec)
	if err != nil {
		return nil, err
	}
	return &Unix{ZMQ: z, sec: sec, opt: defaultUnixOptions(), fallbacks: map[string]uint64{}}, nil
}

// Fallbacks counts the calls that went over ZeroMQ to a same-host peer
// because the Unix path failed, by cause.
func (u *Unix) Fallbacks() map[string]uint64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return maps.Clone(u.fallbacks)
}

func (u *Unix) fellBack(cause string) {
	u.mu.Lock()
	u.fallbacks[cause]++
	u.mu.Unlock()
	metrics.Failed("control_client", "unix_fallback_"+cause)
}

// Serve binds the ZeroMQ server and listens on its Unix name; a name that
// cannot be had (another server of this host holds it) leaves the server
// on ZeroMQ alone, logged and counted.
func (u *Unix) Serve(bind string, h Handler, log *slog.Logger) (Serving, error) {
	if log == nil {
		log = slog.Default()
	}
	sh := &serialHandler{h: h}
	zs, err := u.ZMQ.Serve(bind, sh, log)
	if err != nil {
		return nil, err
	}
	us, ok := listenBeside(zs.Endpoint(), "this server; same-host peers", log, func(name string) (*UnixServer, error) {
		return listenUnix(name, sh, u.sec, log, u.opt)
	})
	if !ok {
		return &dualServer{zmq: zs}, nil
	}
	return &dualServer{zmq: zs, unix: us}, nil
}

// Dial connects a ZeroMQ client and, for an endpoint of this host, a Unix
// client of its name, which calls prefer.
func (u *Unix) Dial(endpoint string, log *slog.Logger) (Caller, error) {
	if log == nil {
		log = slog.Default()
	}
	zc, err := u.ZMQ.Dial(endpoint, log)
	if err != nil {
		return nil, err
	}
	host, _, _ := SplitEndpoint(endpoint) // Dial checked it
	if !isLocalHost(resolve(host)[0]) {
		return zc, nil
	}
	name, err := UnixName(endpoint)
	if err != nil {
		return zc, nil
	}
	uc, err := dialUnix(name, u.sec, log, u.opt)
	if err != nil {
		_ = zc.Close()
		return nil, err
	}
	return &unixCaller{links: u, zmq: zc, unix: uc, log: log}, nil
}

// dualServer is one shard's server over ZeroMQ and, when it could listen,
// over Unix; Stats adds both.
type dualServer struct {
	zmq  Serving
	unix *UnixServer
}

func (d *dualServer) Endpoint() string { return d.zmq.Endpoint() }

// UnixEndpoint is the abstract name served, empty when none.
func (d *dualServer) UnixEndpoint() string {
	if d.unix == nil {
		return ""
	}
	return d.unix.Endpoint()
}

func (d *dualServer) Stats() ServerStats {
	out := d.zmq.Stats()
	if d.unix == nil {
		return out
	}
	us := d.unix.Stats()
	out.Served += us.Served
	out.ServedUnix += us.Served
	out.SendFailures += us.SendFailures
	out.Oversized += us.Oversized
	out.HeldPeak = max(out.HeldPeak, us.HeldPeak)
	out.Errors = addCounts(out.Errors, us.Errors)
	out.Refused = addCounts(out.Refused, us.Refused)
	return out
}

func addCounts(a, b map[string]uint64) map[string]uint64 {
	if len(b) == 0 {
		return a
	}
	out := maps.Clone(a)
	if out == nil {
		out = map[string]uint64{}
	}
	for k, v := range b {
		out[k] += v
	}
	return out
}

func (d *dualServer) Close() error {
	if d.unix != nil {
		_ = d.unix.Close()
	}
	return d.zmq.Close()
}

// unixCaller calls a same-host server over Unix, and over ZeroMQ while
// the Unix path is out of reach. A call that may have reached the server
// over Unix is never sent again over ZeroMQ: the server would do it twice.
type unixCaller struct {
	links *Unix
	zmq   Caller
	unix  *UnixClient
	log   *slog.Logger

	mu      sync.Mutex
	retryAt time.Time // while in the future, calls go over ZeroMQ
	cause   string    // why, "" while the Unix path works
}

func (c *unixCaller) Call(ctx context.Context, op wire.Op, body, out any) error {
	ctx, cancel := callContext(ctx, DefaultCallTimeout)
	defer cancel()
	c.mu.Lock()
	skip := time.Now().Before(c.retryAt)
	cause := c.cause
	c.mu.Unlock()
	if skip {
		c.links.fellBack(cause)
		return c.zmq.Call(ctx, op, body, out)
	}
	err := c.unix.call(ctx, op, body, out)
	if !errors.Is(err, errNotSent) {
		c.mu.Lock()
		if c.cause != "" {
			c.log.Info("control: unix path to the server restored", "name", c.unix.Endpoint())
			c.cause = ""
		}
		c.mu.Unlock()
		return err
	}
	if errors.Is(err, ErrClosed) {
		return err
	}
	cause = unixCause(err)
	c.mu.Lock()
	c.retryAt = time.Now().Add(unixRetry)
	if c.cause != cause {
		c.log.Warn("control: unix path to a same-host server failed; calling over ZeroMQ", "name", c.unix.Endpoint(), "cause", cause, "err", err)
	}
	c.cause = cause
	c.mu.Unlock()
	c.links.fellBack(cause)
	return c.zmq.Call(ctx, op, body, out)
}

// unixCause names why a call could not go over Unix.
func unixCause(err error) string {
	switch {
	case errors.Is(err, ErrAuth):
		return "auth"
	case errors.Is(err, errUnixBusy):
		return "busy"
	case errors.Is(err, errUnixHandshake):
		return "handshake"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), errors.Is(err, os.ErrDeadlineExceeded):
		return "timeout"
	case errors.Is(err, errUnixUnreachable):
		return "unreachable"
	}
	return "handshake"
}

func (c *unixCaller) Close() error {
	_ = c.unix.Close()
	return c.zmq.Close()
}

// Stats are the ZeroMQ client's counters plus the Unix client's round
// trips, so that a caller's totals do not depend on the path.
func (c *unixCaller) Stats() ClientStats {
	var out ClientStats
	if s, ok := c.zmq.(interface{ Stats() ClientStats }); ok {
		out = s.Stats()
	}
	us := c.unix.Stats()
	out.RoundTrips += us.RoundTrips
	out.LateReplies += us.LateReplies
	out.BadReplies += us.BadReplies
	return out
}

func (c *unixCaller) String() string { return fmt.Sprintf("unix+zmq caller of %s", c.unix.Endpoint()) }
