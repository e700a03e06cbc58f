package control

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// EventQueue bounds both the events a publisher holds for its socket and
// the decoded events a subscriber holds for its reader.
const EventQueue = 4096

// PubStats counts what a publisher did with the events it was given.
type PubStats struct {
	Sent    uint64 // handed to libzmq
	Dropped uint64 // queue full (no subscriber, or one not keeping up)
	Invalid uint64 // refused by wire validation (a bug in the caller)
	// SentUnix counts, of Sent, the events written to same-host
	// subscribers over the Unix path; WriteFailures the subscribers that
	// lost their connection to a write that failed or passed its deadline.
	SentUnix      uint64 `json:",omitempty"`
	WriteFailures uint64 `json:",omitempty"`
	// Refused counts subscribers turned away by the security handshake,
	// by reason.
	Refused map[string]uint64 `json:",omitempty"`
}

// EventPub is a PUSH socket on which a consumer shard publishes readiness
// and abandon events to its scheduler.
type EventPub struct {
	*owner
	sock     *zmq.Socket // owner goroutine only, once NewEventPub returns
	guard    *guard
	endpoint string

	// mu makes sequence numbers and queue order agree, so a subscriber
	// sees seq increase by one per event unless some were dropped.
	mu  sync.Mutex
	seq uint64
	q   chan []byte

	head []byte // owner only: a frame the socket could not take yet

	sent, dropped, invalid atomic.Uint64
}

// NewEventPub binds a PUSH socket to an ephemeral port on host ("*" for
// every interface) and publishes on a new goroutine until Close. The
// publisher is the security server of its subscribers: with a secret only
// holders of it can read the events.
func NewEventPub(zctx *zmq.Context, host string, log *slog.Logger, opts ...ServerOption) (*EventPub, error) {
	if host == "" {
		return nil, fmt.Errorf("control: new event pub: %w: empty host", ErrBadEndpoint)
	}
	sock, g, err := newGuardedSocket(zctx, zmq.PUSH, serverOpts(opts), host, log)
	if err != nil {
		return nil, err
	}
	endpoint, err := bindAll(sock, host, 0, log)
	if err == nil {
		err = g.bound(endpoint)
	}
	if err != nil {
		closeGuarded(sock, g)
		return nil, err
	}
	p := &EventPub{
		sock:     sock,
		guard:    g,
		endpoint: endpoint,
		q:        make(chan []byte, EventQueue),
	}
	if p.owner, err = newOwner(log, "event pub "+endpoint, pollItem{sock: sock, serve: p.flush, want: p.wants}, g.monitor()); err != nil {
		closeGuarded(sock, g)
		return nil, err
	}
	p.onExit = g.close
	p.start()
	return p, nil
}

// Endpoint is where subscribers connect.
func (p *EventPub) Endpoint() string { return p.endpoint }

// Send stamps ev with the protocol version and the next sequence number and
// queues it. It never blocks: when the queue is full (no subscriber yet, or
// one not keeping up) the event is dropped and counted, and the gap in seq
// tells the scheduler to resync with the status op.
func (p *EventPub) Send(ev wire.Event) {
	p.mu.Lock()
	p.seq++
	frame, err := stampEvent(ev, p.seq)
	if err != nil {
		p.mu.Unlock()
		p.invalid.Add(1)
		p.log.Error("control: event refused", "transfer_id", ev.TransferID, "err", err)
		return
	}
	p.enqueueLocked(frame)
	p.mu.Unlock()
}

// stampEvent stamps ev with the protocol version, seq and the time, and
// encodes it.
func stampEvent(ev wire.Event, seq uint64) ([]byte, error) {
	ev.V = wire.Version
	ev.Seq = seq
	ev.SentNS = time.Now().UnixNano()
	return wire.EncodeEvent(ev)
}

// enqueueLocked queues a stamped frame, or drops and counts it when the
// queue is full. The caller holds the lock that orders its seq.
func (p *EventPub) enqueueLocked(frame []byte) {
	select {
	case p.q <- frame:
		p.wakeup()
	default:
		p.dropped.Add(1)
	}
}

// Stats returns the counters.
func (p *EventPub) Stats() PubStats {
	st := PubStats{Sent: p.sent.Load(), Dropped: p.dropped.Load(), Invalid: p.invalid.Load()}
	if r := p.guard.stats(); len(r) > 0 {
		st.Refused = r
	}
	return st
}

// Close stops publishing and closes the socket; queued events are lost.
// Idempotent.
func (p *EventPub) Close() error { p.stop(); return nil }

// wants is what the owner waits for on the socket: room, while a frame
// waits for it. Owner only.
func (p *EventPub) wants() zmq.State {
	if p.head != nil {
		return zmq.POLLOUT
	}
	return 0
}

// flush sends queued frames until the socket pushes back (no subscriber
// connected, or its queue full); the refused frame waits in head.
func (p *EventPub) flush() error {
	for {
		if p.head == nil {
			select {
			case f := <-p.q:
				p.head = f
			default:
				return nil
			}
		}
		_, err := p.sock.SendBytes(p.head, zmq.DONTWAIT)
		if isAgain(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("send: %w", err)
		}
		p.sent.Add(1)
		p.head = nil
	}
}

// SubStats counts what a subscriber received.
type SubStats struct {
	Received uint64 // decoded and valid, handed to Events
	Bad      uint64 // frames that did not decode or validate; dropped
	// Over the Unix path: ReceivedUnix counts, of Received, the events
	// read there, Gaps the events a publisher's seq skipped (dropped on
	// its side; the scheduler's status resync covers them), Redials the
	// lost subscriptions dialled again.
	ReceivedUnix uint64 `json:",omitempty"`
	Gaps         uint64 `json:",omitempty"`
	Redials      uint64 `json:",omitempty"`
	// Refused counts the publishers' refusals of this subscriber's
	// handshakes, by reason.
	Refused map[string]uint64 `json:",omitempty"`
}

// EventSub is a PULL socket on which a scheduler gathers the events of
// every shard it follows.
type EventSub struct {
	*owner
	sock *zmq.Socket // owner goroutine only, once NewEventSub returns
	hs   *handshakes // owner goroutine only
	// refusals is hs's own count; any goroutine.
	refusals *Refusals

	connq     chan connectReq
	out       chan wire.Event
	connected map[string]bool // owner only

	received, bad atomic.Uint64
}

// connectQueue bounds Connect requests waiting for the owner.
const connectQueue = 64

type connectReq struct {
	endpoint string
	res      chan error
}

// NewEventSub opens a PULL socket and receives on a new goroutine until
// Close. It connects to nothing until Connect. WithClientSecurity makes it
// a CURVE client of every publisher; the call timeout does not apply.
func NewEventSub(zctx *zmq.Context, log *slog.Logger, opts ...ClientOption) (*EventSub, error) {
	sock, err := newSocket(zctx, zmq.PULL)
	if err != nil {
		return nil, err
	}
	hs, err := newHandshakes(zctx, sock, clientOpts(opts), log)
	if err != nil {
		sock.Close()
		return nil, fmt.Errorf("control: new event sub: %w", err)
	}
	s := &EventSub{
		sock:      sock,
		hs:        hs,
		refusals:  hs.seen,
		connq:     make(chan connectReq, connectQueue),
		out:       make(chan wire.Event, EventQueue),
		connected: map[string]bool{},
	}
	// The refusal is logged once by handshakes; the scheduler's control
	// calls to the same shard fail with it too, which is where it
	// surfaces.
	ignore := func(string, error) {}
	if s.owner, err = newOwner(log, "event sub", pollItem{sock: sock, serve: s.serve}, hs.monitor(ignore)); err != nil {
		sock.Close()
		hs.mon.Close()
		return nil, err
	}
	s.onExit = func() { close(s.out) }
	s.start()
	return s, nil
}

// Connect adds a publisher. Any goroutine, any time; connecting twice to
// one endpoint is a no-op. It does not wait for the publisher to be up.
func (s *EventSub) Connect(endpoint string) error {
	target, err := connectEndpoint(endpoint)
	if err != nil {
		return err
	}
	req := connectReq{endpoint: target, res: make(chan error, 1)}
	select {
	case s.connq <- req:
	case <-s.done:
		return fmt.Errorf("control: connect events %s: %w", endpoint, s.err)
	}
	s.wakeup()
	select {
	case err := <-req.res:
		if err != nil {
			return fmt.Errorf("control: connect events %s: %w", endpoint, err)
		}
		return nil
	case <-s.done:
		return fmt.Errorf("control: connect events %s: %w", endpoint, s.err)
	}
}

// Events delivers decoded, validated events. It is closed when the
// subscriber stops. A reader that falls behind holds the socket back:
// libzmq and then the publishers queue, and publishers drop when full.
func (s *EventSub) Events() <-chan wire.Event { return s.out }

// Stats returns the counters.
func (s *EventSub) Stats() SubStats {
	return SubStats{Received: s.received.Load(), Bad: s.bad.Load(), Refused: s.refusals.Snapshot()}
}

// Close stops receiving, closes the socket and then the Events channel.
// Idempotent.
func (s *EventSub) Close() error {
	s.stop()
	return nil
}

// serve receives, connects what was asked and reconnects when due. Owner
// only.
func (s *EventSub) serve() error {
	if err := s.receive(); err != nil {
		return err
	}
	s.serveConnects()
	for _, ep := range s.hs.due(time.Now()) {
		if !s.connected[ep] {
			s.hs.forget(ep) // not a name we connected to: nothing to renew
			continue
		}
		_ = s.sock.Disconnect(ep)
		if err := s.sock.Connect(ep); err != nil {
			s.log.Warn("control: reconnect events failed", "peer", ep, "err", err)
		}
	}
	return nil
}

func (s *EventSub) serveConnects() {
	for {
		select {
		case req := <-s.connq:
			s.connect(req)
		default:
			return
		}
	}
}

func (s *EventSub) connect(req connectReq) {
	if s.connected[req.endpoint] {
		req.res <- nil
		return
	}
	if err := s.sock.Connect(req.endpoint); err != nil {
		req.res <- err
		return
	}
	s.connected[req.endpoint] = true
	req.res <- nil
}

// receive reads a batch and hands each valid event to the reader. While
// the reader is behind it waits, still serving Connect and Close, and
// reads nothing more: that is the back-pressure.
func (s *EventSub) receive() error { return recvEach(s.sock, s.handleEvent) }

// handleEvent hands one event to the reader; false when the subscriber
// is closing.
func (s *EventSub) handleEvent(m capped) bool {
	if m.over || len(m.parts) != 1 {
		s.bad.Add(1)
		return true
	}
	ev, err := wire.DecodeEvent(m.parts[0])
	if err != nil {
		s.bad.Add(1)
		s.log.Warn("control: undecodable event", "err", err)
		return true
	}
	s.received.Add(1)
	for {
		select {
		case s.out <- ev:
			return true
		case req := <-s.connq:
			s.connect(req)
		case <-s.quit:
			return false
		}
	}
}
