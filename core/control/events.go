package control

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// EventQueue bounds the events a publisher holds for its socket (however
// they are packed into messages) and the messages of decoded events a
// subscriber holds for its reader.
const EventQueue = 4096

// PubStats counts what a publisher did with the events it was given.
type PubStats struct {
	Sent uint64 // events handed to libzmq
	// Messages counts the event messages those events travelled in.
	Messages uint64 `json:",omitempty"`
	Dropped  uint64 // queue full (no subscriber, or one not keeping up)
	Invalid  uint64 // refused by wire validation (a bug in the caller)
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
	q   chan eventMsg // at most EventQueue events in all (queued)
	// queued counts the events in q: the bound is in events, as it was
	// when each message held one, whatever a message holds.
	queued atomic.Int64

	head *eventMsg // owner only: a message the socket could not take yet

	sent, messages, dropped, invalid atomic.Uint64
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
		q:        make(chan eventMsg, EventQueue),
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

// Send stamps evs with the protocol version and the next sequence
// numbers and queues their message. It never blocks: when the queue is
// full (no subscriber yet, or one not keeping up) the message is dropped
// and counted, and the gap in seq tells the scheduler to resync with the
// status op.
func (p *EventPub) Send(evs ...wire.Event) {
	p.mu.Lock()
	for _, m := range stampEvents(evs, &p.seq, p.refuse) {
		p.enqueueLocked(m)
	}
	p.mu.Unlock()
}

func (p *EventPub) refuse(ev wire.Event, err error) {
	p.invalid.Add(1)
	p.log.Error("control: event refused", "transfer_id", ev.TransferID, "err", err)
}

// eventMsg is one encoded event message and how many events it holds.
type eventMsg struct {
	frame  []byte
	events int
}

// stampEvents stamps evs with the protocol version, the seqs after *seq
// and the time, and packs them into as few messages as the bounds allow
// (wire.MaxEventRecords, wire.MaxMessage). An event that fails validation
// (a bug in the caller) is handed to refuse and left out, its seq spent:
// the gap makes the scheduler resync, as for a dropped one. The caller
// holds the lock that orders *seq with its queues.
func stampEvents(evs []wire.Event, seq *uint64, refuse func(wire.Event, error)) []eventMsg {
	now := time.Now().UnixNano()
	var out []eventMsg
	var run []wire.Event
	size := wire.EventHeaderSize
	flush := func() {
		if len(run) == 0 {
			return
		}
		if b, err := wire.EncodeEvents(run); err != nil {
			for _, ev := range run { // cannot be: every one was checked
				refuse(ev, err)
			}
		} else {
			out = append(out, eventMsg{frame: b, events: len(run)})
		}
		run, size = nil, wire.EventHeaderSize
	}
	for _, ev := range evs {
		*seq++
		ev.V, ev.Seq, ev.SentNS, ev.Reason = wire.Version, *seq, now, wire.CutReason(ev.Reason)
		if err := ev.Validate(); err != nil {
			// The run stops here, so that seqs within a message stay
			// consecutive.
			flush()
			refuse(ev, err)
			continue
		}
		n := wire.EventRecordSize(ev)
		if len(run) == wire.MaxEventRecords || size+n > wire.MaxMessage {
			flush()
		}
		run = append(run, ev)
		size += n
	}
	flush()
	return out
}

// enqueueLocked queues a stamped frame, or drops and counts it when the
// queue is full. The caller holds the lock that orders its seq.
func (p *EventPub) enqueueLocked(m eventMsg) {
	if !reserveEvents(&p.queued, m.events, EventQueue) {
		p.dropped.Add(uint64(m.events))
		return
	}
	select {
	case p.q <- m:
		p.wakeup()
	default: // cannot be: q holds EventQueue messages of one event or more
		p.queued.Sub(int64(m.events))
		p.dropped.Add(uint64(m.events))
	}
}

// reserveEvents counts n more events into a queue that holds at most
// limit, or says there is no room. Its callers hold the lock that orders
// the queue's sends; the reader only takes away.
func reserveEvents(queued *atomic.Int64, n, limit int) bool {
	if queued.Load()+int64(n) > int64(limit) {
		return false
	}
	queued.Add(int64(n))
	return true
}

// Stats returns the counters.
func (p *EventPub) Stats() PubStats {
	st := PubStats{Sent: p.sent.Load(), Messages: p.messages.Load(), Dropped: p.dropped.Load(), Invalid: p.invalid.Load()}
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
			case m := <-p.q:
				p.queued.Sub(int64(m.events))
				p.head = &m
			default:
				return nil
			}
		}
		_, err := p.sock.SendBytes(p.head.frame, zmq.DONTWAIT)
		if isAgain(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("send: %w", err)
		}
		p.sent.Add(uint64(p.head.events))
		p.messages.Add(1)
		p.head = nil
	}
}

// SubStats counts what a subscriber received.
type SubStats struct {
	Received uint64 // events decoded and valid, handed to Events
	Messages uint64 `json:",omitempty"` // the event messages they came in
	Bad      uint64 // frames that did not decode or validate; dropped
	// Legacy counts, of Bad, the JSON events of a publisher of an older
	// build (wire.ErrLegacyEvent): refused, since shard and scheduler run
	// from one library; the status resync still finds their transfers.
	Legacy uint64 `json:",omitempty"`
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
	out       chan []wire.Event
	connected map[string]bool // owner only

	received, messages, bad, legacy atomic.Uint64
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
		out:       make(chan []wire.Event, EventQueue),
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
func (s *EventSub) Events() <-chan []wire.Event { return s.out }

// Stats returns the counters.
func (s *EventSub) Stats() SubStats {
	return SubStats{Received: s.received.Load(), Messages: s.messages.Load(), Bad: s.bad.Load(), Legacy: s.legacy.Load(),
		Refused: s.refusals.Snapshot()}
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

// handleEvent hands one message's events to the reader; false when the
// subscriber is closing.
func (s *EventSub) handleEvent(m capped) bool {
	if m.over || len(m.parts) != 1 {
		s.bad.Add(1)
		return true
	}
	evs, err := wire.DecodeEvents(m.parts[0])
	if err != nil {
		badEvent(s.log, &s.bad, &s.legacy, err)
		return true
	}
	s.received.Add(uint64(len(evs)))
	s.messages.Add(1)
	for {
		select {
		case s.out <- evs:
			return true
		case req := <-s.connq:
			s.connect(req)
		case <-s.quit:
			return false
		}
	}
}

// badEvent counts and logs a frame that is not a valid event message. A
// JSON event is counted apart and logged as what it is, once per
// subscriber and then at debug level: a publisher of an older build sends
// nothing else, and one line per event would flood the log.
func badEvent(log *slog.Logger, bad, legacy *atomic.Uint64, err error) {
	bad.Add(1)
	if !errors.Is(err, wire.ErrLegacyEvent) {
		log.Warn("control: undecodable event", "err", err)
		return
	}
	metrics.Failed("control", "event_legacy_json")
	if legacy.Add(1) == 1 {
		log.Error("control: a publisher sends JSON events, from a build older than this scheduler's; refused (shard and scheduler "+
			"must run one build): its transfers are found by the status resync only", "err", err)
		return
	}
	log.Debug("control: JSON event refused", "err", err)
}
