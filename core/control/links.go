package control

import (
	"context"
	"fmt"
	"log/slog"

	zmq "github.com/pebbe/zmq4"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// The control plane as the runtimes see it: a few small interfaces, so that
// a consumer shard, a producer and a scheduler run the same over ZeroMQ
// (ZMQ, the production links) and over the in-memory fake (Inmem), which
// can cut, delay and heal any link.

// Caller is a producer's or a scheduler's client of one shard's server.
// Call has Client.Call's contract: a server's refusal is a *wire.Error, an
// expired context its ctx.Err(), a closed caller ErrClosed.
type Caller interface {
	Call(ctx context.Context, op wire.Op, body, out any) error
	Close() error
}

// Serving is a shard's control server, answering with its Handler.
type Serving interface {
	Endpoint() string
	Stats() ServerStats
	Close() error
}

// Publisher is a shard's event channel to its scheduler. Send publishes
// the events of one flush, in order, as one event message (several only
// past wire.MaxEventRecords or wire.MaxMessage), and never blocks.
type Publisher interface {
	Endpoint() string
	Send(evs ...wire.Event)
	Stats() PubStats
	Close() error
}

// Subscriber gathers the events of every publisher it connected to. Each
// value on Events is one event message's events, of one publisher, in
// order: the reader applies them as one batch. Events is closed once
// Close returns.
type Subscriber interface {
	Connect(endpoint string) error
	Events() <-chan []wire.Event
	Stats() SubStats
	Close() error
}

// Poller is a Subscriber whose caller can take same-host publishers'
// events on its own thread. A thread that polls anyway (vLLM's engine
// loop steps without pause while a request waits) then sees an event as
// soon as it is in the socket, instead of after the wake of a reader
// thread that slept, which costs tens of microseconds after an idle gap.
type Poller interface {
	Subscriber
	// Direct makes the events of publishers followed on this host go to
	// fn instead of Events: called with one message's events, in order per
	// publisher, once each, by the reader goroutine or by Poll, never two
	// at a time for one publisher. Call it before Connect; fn must not
	// block for long, nor call back into the subscriber.
	Direct(fn func([]wire.Event))
	// Poll delivers to Direct's fn, on the calling goroutine, whatever has
	// arrived and not been delivered yet, without waiting for more, and
	// returns how many events it delivered. A publisher whose reader is
	// delivering at that moment is skipped: its events are being
	// delivered. Without Direct it delivers nothing.
	Poll() int
}

// Links opens the control-plane links of one process object, which owns
// them: it closes every link it opened, then the Links.
type Links interface {
	Serve(bind string, h Handler, log *slog.Logger) (Serving, error)
	Publish(host string, log *slog.Logger) (Publisher, error)
	Dial(endpoint string, log *slog.Logger) (Caller, error)
	Subscribe(log *slog.Logger) (Subscriber, error)
	Close() error
}

var (
	_ Caller     = (*Client)(nil)
	_ Serving    = (*Server)(nil)
	_ Publisher  = (*EventPub)(nil)
	_ Subscriber = (*EventSub)(nil)
	_ Links      = (*ZMQ)(nil)
)

// ZMQ is the production Links: sockets of one zmq context, every one
// secured as sec says (servers admit, clients present, its keys).
type ZMQ struct {
	zctx *zmq.Context
	sec  Security
	// refused counts the refusals every client and subscriber opened here
	// saw, including those of sockets closed since.
	refused Refusals
}

// RefusalCounter is a Links that counts the security refusals its clients
// saw (ZMQ does; the in-memory fake has no handshake to refuse).
type RefusalCounter interface {
	Refused() map[string]uint64
}

var _ RefusalCounter = (*ZMQ)(nil)

// Refused returns the refusals that the clients and subscribers of these
// links saw, by reason; nil when none.
func (z *ZMQ) Refused() map[string]uint64 { return z.refused.Snapshot() }

// OpenLinks derives the security of the secret that load reads and
// returns given, or, when given is nil, ZeroMQ links secured with it; the
// security comes back too, since it is checked even when links are
// given. role begins every error. allowUnauthenticated is NewSecurity's.
//
// WithUnixPath(true) opens Unix links (NewUnix) instead of plain ZeroMQ.
func OpenLinks(role string, load func() (string, error), allowUnauthenticated bool, given Links, opts ...LinksOption) (Links, Security, error) {
	var o linksOptions
	for _, f := range opts {
		f(&o)
	}
	secret, err := load()
	if err != nil {
		return nil, Security{}, fmt.Errorf("%s: %w", role, err)
	}
	sec, err := NewSecurity(secret, allowUnauthenticated)
	if err != nil {
		return nil, Security{}, fmt.Errorf("%s: auth_secret: %w", role, err)
	}
	if given != nil {
		return given, sec, nil
	}
	if o.unix {
		u, err := NewUnix(sec)
		if err != nil {
			return nil, Security{}, fmt.Errorf("%s: %w", role, err)
		}
		return u, sec, nil
	}
	z, err := NewZMQ(sec)
	if err != nil {
		return nil, Security{}, fmt.Errorf("%s: %w", role, err)
	}
	return z, sec, nil
}

// LinksOption configures OpenLinks.
type LinksOption func(*linksOptions)

type linksOptions struct{ unix bool }

// WithUnixPath selects the Unix links for same-host peers (control_unix).
func WithUnixPath(on bool) LinksOption { return func(o *linksOptions) { o.unix = on } }

// CloseIfFailed closes l, if there is one, when *err is set: deferred by a
// constructor that owns the links it is given, so that it closes them
// however it fails.
func CloseIfFailed(err *error, l Links) {
	if *err != nil && l != nil {
		_ = l.Close()
	}
}

// NewZMQ opens the zmq context of one process object.
func NewZMQ(sec Security) (*ZMQ, error) {
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("zmq context: %w", err)
	}
	return &ZMQ{zctx: zctx, sec: sec}, nil
}

// Serve binds a ROUTER server (NewServer).
func (z *ZMQ) Serve(bind string, h Handler, log *slog.Logger) (Serving, error) {
	s, err := NewServer(z.zctx, bind, h, log, WithServerSecurity(z.sec))
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Publish binds an event PUSH socket (NewEventPub).
func (z *ZMQ) Publish(host string, log *slog.Logger) (Publisher, error) {
	p, err := NewEventPub(z.zctx, host, log, WithServerSecurity(z.sec))
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Dial connects a DEALER client (Dial).
func (z *ZMQ) Dial(endpoint string, log *slog.Logger) (Caller, error) {
	c, err := Dial(z.zctx, endpoint, log, WithClientSecurity(z.sec), WithRefusals(&z.refused))
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Subscribe opens an event PULL socket (NewEventSub).
func (z *ZMQ) Subscribe(log *slog.Logger) (Subscriber, error) {
	s, err := NewEventSub(z.zctx, log, WithClientSecurity(z.sec), WithRefusals(&z.refused))
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Close terminates the context once every socket of it is closed.
func (z *ZMQ) Close() error { return z.zctx.Term() }
