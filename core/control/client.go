package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// DefaultCallTimeout bounds a Call whose context has no deadline.
const DefaultCallTimeout = 30 * time.Second

// sendQueue bounds the frames waiting for the owner; a full queue makes
// callers wait (within their deadline) rather than grow memory.
const sendQueue = 1024

// ClientOption configures Dial and NewEventSub.
type ClientOption func(*clientOptions)

type clientOptions struct {
	timeout  time.Duration
	sec      Security
	refusals *Refusals
}

// WithCallTimeout sets the timeout of calls whose context has no deadline.
func WithCallTimeout(d time.Duration) ClientOption {
	return func(o *clientOptions) {
		if d > 0 {
			o.timeout = d
		}
	}
}

// WithClientSecurity makes the socket a CURVE client when sec has a
// secret; the default is plain ZMTP.
func WithClientSecurity(sec Security) ClientOption {
	return func(o *clientOptions) { o.sec = sec }
}

// WithRefusals also counts the socket's refusals in r, which may be
// shared by many sockets.
func WithRefusals(r *Refusals) ClientOption {
	return func(o *clientOptions) { o.refusals = r }
}

func clientOpts(opts []ClientOption) clientOptions {
	o := clientOptions{timeout: DefaultCallTimeout}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// ClientStats counts what a client received.
type ClientStats struct {
	RoundTrips  uint64 // replies matched to a waiting call
	LateReplies uint64 // replies whose call had already given up; dropped
	BadReplies  uint64 // replies that did not decode; dropped, or failing their call when the id was readable
	// Refused counts the server's refusals of this client's handshakes,
	// by reason (the labels of ecm_failures_total{component="control_client"}).
	Refused map[string]uint64 `json:",omitempty"`
}

// Client is a DEALER socket to one server. Calls pipeline: any number of
// goroutines may Call at once; the owner goroutine sends their frames and
// matches replies to callers by request id.
type Client struct {
	*owner
	sock     *zmq.Socket // owner goroutine only, once Dial returns
	hs       *handshakes // owner goroutine only
	refusals *Refusals   // hs's own count; any goroutine
	endpoint string
	target   string // the address connected to
	timeout  time.Duration

	sendq  chan outgoing
	nextID atomic.Uint64

	// calls wait for their replies here. The table is closed with the
	// server's last security refusal and opened again once a handshake
	// succeeds: calls fail with the refusal at once rather than wait for
	// a connection that cannot come.
	calls callTable

	head *outgoing // owner only: a frame the socket could not take yet

	roundTrips, late, bad atomic.Uint64
}

type outgoing struct {
	id    uint64
	frame []byte
}

type result struct {
	rep wire.Reply
	err error
}

// into decodes the reply's body into out (nil: ignore it), or returns
// why there is none to decode: the call's error, else the server's.
func (r result) into(out any) error {
	if r.err != nil {
		return r.err
	}
	return replyInto(r.rep, out)
}

// replyInto decodes rep's body into out (nil: ignore it), or returns the
// server's error.
func replyInto(rep wire.Reply, out any) error {
	if rep.Err != nil {
		return rep.Err
	}
	if out == nil {
		return nil
	}
	return wire.UnmarshalBody(rep.Body, out)
}

// requestFrame encodes the request id of op with body.
func requestFrame(id uint64, op wire.Op, body any) ([]byte, error) {
	req, err := wire.NewRequest(id, op, body)
	if err != nil {
		return nil, err
	}
	return wire.EncodeRequest(req)
}

// callContext gives ctx the bound d when it has none of its own.
func callContext(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, d)
}

// Dial connects a client to endpoint ("tcp://host:port"). It does not wait
// for the server: calls made before the connection is up wait for it
// within their deadline. A hostname is resolved once, here, to its first
// address.
func Dial(zctx *zmq.Context, endpoint string, log *slog.Logger, opts ...ClientOption) (*Client, error) {
	target, err := connectEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	o := clientOpts(opts)
	sock, err := newSocket(zctx, zmq.DEALER)
	if err != nil {
		return nil, err
	}
	hs, err := newHandshakes(zctx, sock, o, log)
	if err != nil {
		sock.Close()
		return nil, fmt.Errorf("control: dial %s: %w", endpoint, err)
	}
	fail := func(err error) (*Client, error) {
		sock.Close()
		hs.mon.Close()
		return nil, err
	}
	// Immediate: queue only to a completed connection. Without it libzmq
	// would hold requests for a dead server and deliver them, long after
	// their callers gave up, when it comes back.
	if err := sock.SetImmediate(true); err != nil {
		return fail(fmt.Errorf("control: dial %s: %w", endpoint, err))
	}
	if err := sock.Connect(target); err != nil {
		return fail(fmt.Errorf("control: dial %s: %w", endpoint, err))
	}
	c := &Client{
		sock:     sock,
		hs:       hs,
		refusals: hs.seen,
		endpoint: endpoint,
		target:   target,
		timeout:  o.timeout,
		sendq:    make(chan outgoing, sendQueue),
		calls:    newCallTable(),
	}
	c.owner, err = newOwner(log, "client "+endpoint, pollItem{sock: sock, serve: c.serve, want: c.wants}, hs.monitor(c.setRefused))
	if err != nil {
		return fail(err)
	}
	c.start()
	return c, nil
}

// Endpoint is the endpoint the client was dialled with.
func (c *Client) Endpoint() string { return c.endpoint }

// Call sends op with body and waits for the reply, decoding its body into
// out (a pointer, or nil to ignore it; validated when it has a Validate
// method). A context without deadline gets the client's default timeout.
// A server's refusal comes back as a *wire.Error (errors.As, or errors.Is
// with the wire sentinels); an expired context as its ctx.Err(); a closed
// client as ErrClosed.
func (c *Client) Call(ctx context.Context, op wire.Op, body any, out any) error {
	ctx, cancel := callContext(ctx, c.timeout)
	defer cancel()
	select {
	case <-c.done:
		return c.fail(op, 0, c.err)
	default:
	}
	id := c.nextID.Add(1)
	frame, err := requestFrame(id, op, body)
	if err != nil {
		return c.fail(op, id, err)
	}
	ch, err := c.calls.add(id)
	if err != nil {
		return c.fail(op, id, err)
	}
	defer c.calls.forget(id)

	select {
	case c.sendq <- outgoing{id: id, frame: frame}:
		c.wakeup()
	case <-ctx.Done():
		return c.fail(op, id, ctx.Err())
	case <-c.done:
		return c.fail(op, id, c.err)
	}
	var res result
	select {
	case res = <-ch:
	case <-ctx.Done():
		// The frame may still wait for room; the owner drops it.
		c.wakeup()
		return c.fail(op, id, ctx.Err())
	case <-c.done:
		return c.fail(op, id, c.err)
	}
	if err := res.into(out); err != nil {
		return c.fail(op, id, err)
	}
	return nil
}

func (c *Client) fail(op wire.Op, id uint64, err error) error {
	return fmt.Errorf("control: %s #%d to %s: %w", op, id, c.endpoint, err)
}

// deliver hands a result to its caller; false when nobody waits for it.
func (c *Client) deliver(id uint64, r result) bool { return c.calls.deliver(id, r, &c.roundTrips) }

// Close fails calls in flight with ErrClosed, stops the owner and closes
// the socket. Idempotent.
func (c *Client) Close() error {
	c.stop()
	return nil
}

// RoundTrips counts replies matched to their calls.
func (c *Client) RoundTrips() uint64 { return c.roundTrips.Load() }

// Stats returns the counters.
func (c *Client) Stats() ClientStats {
	return ClientStats{RoundTrips: c.roundTrips.Load(), LateReplies: c.late.Load(), BadReplies: c.bad.Load(), Refused: c.refusals.Snapshot()}
}

// serve reads the replies, reconnects when due and sends what is queued.
// Owner only.
func (c *Client) serve() error {
	if err := recvEach(c.sock, c.handleReply); err != nil {
		return err
	}
	if err := c.redial(); err != nil {
		return err
	}
	return c.flush()
}

// wants is what the owner waits for on the socket: replies, and room
// while a frame waits for it. Owner only.
func (c *Client) wants() zmq.State {
	if c.head != nil {
		return zmq.POLLIN | zmq.POLLOUT
	}
	return zmq.POLLIN
}

// setRefused records the server's latest security verdict and fails every
// call waiting for it: none of them can be sent. Owner only.
func (c *Client) setRefused(_ string, err error) {
	c.calls.refuse(err)
	if err != nil {
		c.head = nil
	}
}

// redial reconnects after a refusal that libzmq will not retry by itself,
// on a backoff, so that a server whose settings were fixed is reached
// again without a new client. Owner only.
func (c *Client) redial() error {
	// One server per client: whatever name libzmq gave it, the endpoint
	// to renew is the one connected.
	if len(c.hs.due(time.Now())) == 0 {
		return nil
	}
	if err := c.sock.Disconnect(c.target); err != nil && isTerm(err) {
		return fmt.Errorf("disconnect: %w", err)
	}
	if err := c.sock.Connect(c.target); err != nil {
		return fmt.Errorf("reconnect %s: %w", c.target, err)
	}
	return nil
}

// flush sends queued frames until the socket pushes back; the frame it
// refused waits in head for POLLOUT. A frame whose caller gave up is not
// sent: the server would do work nobody waits for.
func (c *Client) flush() error {
	for {
		if c.head == nil {
			select {
			case o := <-c.sendq:
				c.head = &o
			default:
				return nil
			}
		}
		if !c.calls.waiting(c.head.id) {
			c.head = nil
			continue
		}
		_, err := c.sock.SendBytes(c.head.frame, zmq.DONTWAIT)
		if isAgain(err) {
			return nil
		}
		if err != nil && isTerm(err) {
			return fmt.Errorf("send: %w", err)
		}
		if err != nil {
			c.deliver(c.head.id, result{err: fmt.Errorf("send: %w", err)})
		}
		c.head = nil
	}
}

// handleReply hands one reply to its caller; it always asks for the next.
func (c *Client) handleReply(m capped) bool {
	var rep wire.Reply
	err := errors.New("want one frame per reply")
	if len(m.parts) == 1 && !m.over {
		rep, err = wire.DecodeReply(m.parts[0])
	}
	if err != nil {
		c.bad.Add(1)
		c.log.Warn("control: undecodable reply", "endpoint", c.endpoint, "id", rep.ID, "err", err)
		// A readable id lets its caller fail now instead of at its deadline.
		if rep.ID != 0 {
			c.deliver(rep.ID, result{err: fmt.Errorf("undecodable reply: %w", err)})
		}
		return true
	}
	if !c.deliver(rep.ID, result{rep: rep}) {
		c.late.Add(1)
	}
	return true
}
