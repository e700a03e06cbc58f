package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// InmemNetwork connects in-memory control-plane links inside one process,
// the way HashiCorp raft's InmemTransport does. Every message still goes
// through the wire codec, every request meets its server's Handler one at
// a time, and every event keeps its publisher's order; only the sockets
// are gone.
//
// Each process object gets its own Links, under a name ("producer",
// "shard-1"). The link between two names can be cut (Partition), slowed
// (SetDelay) and healed (Heal) at any time, in both directions at once:
//   - a request over a cut link, or to an endpoint nobody serves, is lost,
//     and its call waits for its deadline, as a DEALER's does; a reply over
//     a link cut meanwhile is lost the same way;
//   - an event over a cut link is dropped (PubStats.Dropped), as one sent
//     while a socket reconnects is; one with no subscriber yet waits for
//     the first, as a PUSH socket's does;
//   - a delay holds each request, each reply and each event that long.
type InmemNetwork struct {
	mu       sync.Mutex
	servers  map[string]*inmemServer // by endpoint
	pubs     map[string]*inmemPub    // by endpoint
	subs     map[string][]*inmemSub  // subscribers by publisher endpoint
	cut      map[inmemPair]bool
	delay    map[inmemPair]time.Duration
	nextPort int
	callers  atomic.Uint64 // callers dialled, to name each
}

// inmemPair names the link between two Links, in either direction.
type inmemPair struct{ a, b string }

func pairOf(a, b string) inmemPair {
	if b < a {
		a, b = b, a
	}
	return inmemPair{a, b}
}

// NewInmemNetwork returns a network with no links and no faults.
func NewInmemNetwork() *InmemNetwork {
	return &InmemNetwork{
		servers: map[string]*inmemServer{}, pubs: map[string]*inmemPub{}, subs: map[string][]*inmemSub{},
		cut: map[inmemPair]bool{}, delay: map[inmemPair]time.Duration{}, nextPort: 60000,
	}
}

// Links returns the links of one process object, named name in faults.
func (n *InmemNetwork) Links(name string) *InmemLinks {
	return &InmemLinks{n: n, name: name, closing: map[inmemCloser]bool{}}
}

// Partition cuts the link between the objects named a and b.
func (n *InmemNetwork) Partition(a, b string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.cut[pairOf(a, b)] = true
}

// Heal restores the link between a and b.
func (n *InmemNetwork) Heal(a, b string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.cut, pairOf(a, b))
}

// HealAll restores every link and removes every delay.
func (n *InmemNetwork) HealAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.cut)
	clear(n.delay)
}

// SetDelay holds every message between a and b for d (zero removes it).
func (n *InmemNetwork) SetDelay(a, b string, d time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if d <= 0 {
		delete(n.delay, pairOf(a, b))
		return
	}
	n.delay[pairOf(a, b)] = d
}

// link reports the state of the link between a and b.
func (n *InmemNetwork) link(a, b string) (delay time.Duration, cut bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := pairOf(a, b)
	return n.delay[p], n.cut[p]
}

// port hands out a port that no real socket of the process holds.
func (n *InmemNetwork) port() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.nextPort++
	return n.nextPort
}

// unbind takes v out of the network's table of bound endpoints, unless
// another took its endpoint since.
func unbind[V comparable](n *InmemNetwork, bound map[string]V, endpoint string, v V) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if bound[endpoint] == v {
		delete(bound, endpoint)
	}
}

// inmemWait sleeps d, or until done closes (then false).
func inmemWait(d time.Duration, done <-chan struct{}) bool {
	if d <= 0 {
		return true
	}
	select {
	case <-time.After(d):
		return true
	case <-done:
		return false
	}
}

type inmemCloser interface{ Close() error }

// InmemLinks is one process object's links on an InmemNetwork.
type InmemLinks struct {
	n    *InmemNetwork
	name string

	mu      sync.Mutex
	closing map[inmemCloser]bool // what Close closes
	closed  bool
}

var (
	_ Links      = (*InmemLinks)(nil)
	_ Caller     = (*inmemCaller)(nil)
	_ Serving    = (*inmemServer)(nil)
	_ Publisher  = (*inmemPub)(nil)
	_ Subscriber = (*inmemSub)(nil)
)

// Name is the name faults know these links by.
func (l *InmemLinks) Name() string { return l.name }

func (l *InmemLinks) track(c inmemCloser) error {
	l.mu.Lock()
	closed := l.closed
	if !closed {
		l.closing[c] = true
	}
	l.mu.Unlock()
	if closed {
		_ = c.Close()
		return fmt.Errorf("control: inmem links of %s: %w", l.name, ErrClosed)
	}
	return nil
}

func (l *InmemLinks) untrack(c inmemCloser) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.closing, c)
}

// Close closes every link opened through l. Idempotent.
func (l *InmemLinks) Close() error {
	l.mu.Lock()
	l.closed = true
	open := make([]inmemCloser, 0, len(l.closing))
	for c := range l.closing {
		open = append(open, c)
	}
	clear(l.closing)
	l.mu.Unlock()
	for _, c := range open {
		_ = c.Close()
	}
	return nil
}

// endpoint turns a bind address into the endpoint it serves: port 0 gets
// a port of its own.
func (l *InmemLinks) endpoint(bind string) (string, error) {
	host, port, err := SplitEndpoint(bind)
	if err != nil {
		return "", err
	}
	if port == 0 {
		port = l.n.port()
	}
	return Endpoint(host, port), nil
}

// server ------------------------------------------------------------------

type inmemServer struct {
	n        *InmemNetwork
	links    *InmemLinks
	endpoint string
	h        Handler
	log      *slog.Logger

	// mu serialises requests, as the one goroutine of a ROUTER does, and
	// makes Close wait for the request in the handler.
	mu       sync.Mutex
	closed   bool
	counters serverCounters
}

// Serve registers h at bind.
func (l *InmemLinks) Serve(bind string, h Handler, log *slog.Logger) (Serving, error) {
	if h == nil {
		return nil, errors.New("control: new server: nil handler")
	}
	ep, err := l.endpoint(bind)
	if err != nil {
		return nil, err
	}
	s := &inmemServer{n: l.n, links: l, endpoint: ep, h: h, log: log}
	l.n.mu.Lock()
	if _, taken := l.n.servers[ep]; taken {
		l.n.mu.Unlock()
		return nil, fmt.Errorf("control: bind %s: address in use", ep)
	}
	l.n.servers[ep] = s
	l.n.mu.Unlock()
	if err := l.track(s); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *inmemServer) Endpoint() string { return s.endpoint }

func (s *inmemServer) Stats() ServerStats { return s.counters.snapshot() }

func (s *inmemServer) Close() error {
	unbind(s.n, s.n.servers, s.endpoint, s)
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.links.untrack(s)
	return nil
}

// serve answers one request frame as a Server does; false when the server
// closed before it could.
func (s *inmemServer) serve(peer string, frame []byte) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, false
	}
	_, out, ok := s.counters.reply(answer(s.h, s.log, peer, frame), s.log)
	return out, ok
}

// caller ------------------------------------------------------------------

type inmemCaller struct {
	links    *InmemLinks
	endpoint string
	peer     string // what the server names it (Request.Peer)
	nextID   atomic.Uint64
	done     chan struct{}
	once     sync.Once
}

// Dial returns a caller of endpoint; like Dial, it does not wait for a
// server to be there.
func (l *InmemLinks) Dial(endpoint string, _ *slog.Logger) (Caller, error) {
	if _, _, err := SplitEndpoint(endpoint); err != nil {
		return nil, err
	}
	c := &inmemCaller{links: l, endpoint: endpoint, done: make(chan struct{}),
		peer: fmt.Sprintf("inmem:%s#%d", l.name, l.n.callers.Add(1))}
	if err := l.track(c); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *inmemCaller) Close() error {
	c.once.Do(func() { close(c.done) })
	c.links.untrack(c)
	return nil
}

// Call sends the request over the link to the endpoint's owner and waits
// for its reply; a lost message leaves the call to its deadline.
func (c *inmemCaller) Call(ctx context.Context, op wire.Op, body, out any) error {
	ctx, cancel := callContext(ctx, DefaultCallTimeout)
	defer cancel()
	id := c.nextID.Add(1)
	fail := func(err error) error { return fmt.Errorf("control: %s #%d to %s: %w", op, id, c.endpoint, err) }
	select {
	case <-c.done:
		return fail(ErrClosed)
	default:
	}
	frame, err := requestFrame(id, op, body)
	if err != nil {
		return fail(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	ended := make(chan struct{})
	go func() { // ends the hops below when the call gives up
		select {
		case <-ctx.Done():
		case <-c.done:
		case <-stop:
		}
		close(ended)
	}()
	lost := func() error {
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-c.done:
			return fail(ErrClosed)
		}
	}
	reply, ok := c.roundTrip(frame, ended)
	if !ok {
		return lost()
	}
	rep, err := wire.DecodeReply(reply)
	if err != nil {
		return fail(fmt.Errorf("undecodable reply: %w", err))
	}
	if err := replyInto(rep, out); err != nil {
		return fail(err)
	}
	return nil
}

// roundTrip carries frame to the server and its reply back, hop by hop;
// false when either was lost or the call ended first.
func (c *inmemCaller) roundTrip(frame []byte, ended <-chan struct{}) ([]byte, bool) {
	n := c.links.n
	n.mu.Lock()
	s := n.servers[c.endpoint]
	n.mu.Unlock()
	if s == nil {
		return nil, false
	}
	hop := func() bool {
		d, cut := n.link(c.links.name, s.links.name)
		if !inmemWait(d, ended) {
			return false
		}
		if d > 0 { // the link may have been cut while the message travelled
			_, cut = n.link(c.links.name, s.links.name)
		}
		return !cut
	}
	if !hop() {
		return nil, false
	}
	reply, ok := s.serve(c.peer, frame)
	if !ok || !hop() {
		return nil, false
	}
	return reply, true
}

// events ------------------------------------------------------------------

type inmemPub struct {
	n        *InmemNetwork
	links    *InmemLinks
	endpoint string
	log      *slog.Logger

	mu     sync.Mutex // orders seq with the queue, as EventPub's does
	seq    uint64
	q      chan eventMsg
	queued atomic.Int64 // events in q: at most EventQueue, as EventPub's

	wake chan struct{} // a subscriber connected
	quit chan struct{}
	done chan struct{}
	once sync.Once

	sent, dropped, invalid, messages atomic.Uint64
}

// Publish opens a publisher on host, on a port of its own.
func (l *InmemLinks) Publish(host string, log *slog.Logger) (Publisher, error) {
	if host == "" {
		return nil, fmt.Errorf("control: new event pub: %w: empty host", ErrBadEndpoint)
	}
	if log == nil {
		log = slog.Default() // as the real publishers: a refusal is logged
	}
	ep := Endpoint(host, l.n.port())
	p := &inmemPub{
		n: l.n, links: l, endpoint: ep, log: log, q: make(chan eventMsg, EventQueue),
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{}),
	}
	l.n.mu.Lock()
	l.n.pubs[ep] = p
	l.n.mu.Unlock()
	if err := l.track(p); err != nil {
		return nil, err
	}
	go p.pump()
	return p, nil
}

func (p *inmemPub) Endpoint() string { return p.endpoint }

func (p *inmemPub) Send(evs ...wire.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range stampEvents(evs, &p.seq, p.refuse) {
		if !reserveEvents(&p.queued, m.events, EventQueue) {
			p.dropped.Add(uint64(m.events))
			continue
		}
		select {
		case p.q <- m:
		default: // cannot be: q holds EventQueue messages of one event or more
			p.queued.Sub(int64(m.events))
			p.dropped.Add(uint64(m.events))
		}
	}
}

func (p *inmemPub) refuse(ev wire.Event, err error) {
	p.invalid.Add(1)
	p.log.Error("control: event refused", "transfer_id", ev.TransferID, "err", err)
}

func (p *inmemPub) Stats() PubStats {
	return PubStats{Sent: p.sent.Load(), Messages: p.messages.Load(), Dropped: p.dropped.Load(), Invalid: p.invalid.Load()}
}

// Close stops the pump and waits for it; queued events are lost.
func (p *inmemPub) Close() error {
	p.once.Do(func() {
		unbind(p.n, p.n.pubs, p.endpoint, p)
		close(p.quit)
		<-p.done
	})
	p.links.untrack(p)
	return nil
}

// pump delivers queued events in order to every subscriber, waiting for
// the first to connect.
func (p *inmemPub) pump() {
	defer close(p.done)
	for {
		var m eventMsg
		select {
		case m = <-p.q:
			p.queued.Sub(int64(m.events))
		case <-p.quit:
			return
		}
		var subs []*inmemSub
		for {
			p.n.mu.Lock()
			subs = append(subs[:0], p.n.subs[p.endpoint]...)
			p.n.mu.Unlock()
			if len(subs) > 0 {
				break
			}
			select {
			case <-p.wake:
			case <-p.quit:
				return
			}
		}
		for _, s := range subs {
			d, _ := p.n.link(p.links.name, s.links.name)
			if !inmemWait(d, p.quit) {
				return
			}
			if _, cut := p.n.link(p.links.name, s.links.name); cut {
				p.dropped.Add(uint64(m.events))
				continue
			}
			s.deliver(m.frame, p.quit, func() {
				p.sent.Add(uint64(m.events))
				p.messages.Add(1)
			})
		}
	}
}

type inmemSub struct {
	n     *InmemNetwork
	links *InmemLinks
	log   *slog.Logger
	out   chan []wire.Event

	// mu is held for reading while an event is handed over, so that Close
	// closes out only once nobody can send on it.
	mu     sync.RWMutex
	closed bool
	quit   chan struct{}
	once   sync.Once

	received, messages, bad, legacy atomic.Uint64
}

// Subscribe opens a subscriber connected to nothing.
func (l *InmemLinks) Subscribe(log *slog.Logger) (Subscriber, error) {
	if log == nil {
		log = slog.Default()
	}
	s := &inmemSub{n: l.n, links: l, log: log, out: make(chan []wire.Event, EventQueue), quit: make(chan struct{})}
	if err := l.track(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Connect subscribes to the publisher at endpoint, now or once it exists.
func (s *inmemSub) Connect(endpoint string) error {
	if _, _, err := SplitEndpoint(endpoint); err != nil {
		return err
	}
	select {
	case <-s.quit:
		return fmt.Errorf("control: connect events %s: %w", endpoint, ErrClosed)
	default:
	}
	s.n.mu.Lock()
	defer s.n.mu.Unlock()
	for _, x := range s.n.subs[endpoint] {
		if x == s {
			return nil
		}
	}
	s.n.subs[endpoint] = append(s.n.subs[endpoint], s)
	if p := s.n.pubs[endpoint]; p != nil {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
	return nil
}

func (s *inmemSub) Events() <-chan []wire.Event { return s.out }

func (s *inmemSub) Stats() SubStats {
	return SubStats{Received: s.received.Load(), Messages: s.messages.Load(), Bad: s.bad.Load(), Legacy: s.legacy.Load()}
}

// deliver decodes a message and hands its events to the reader, waiting
// while the reader is behind, until the subscriber or the publisher closes.
// handed runs once the frame is known to be deliverable, before the reader
// can have it, so that the publisher counts it sent as libzmq's does: a
// reader that has an event finds it counted on both sides.
func (s *inmemSub) deliver(frame []byte, pubQuit <-chan struct{}, handed func()) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return
	}
	evs, err := wire.DecodeEvents(frame)
	if err != nil {
		badEvent(s.log, &s.bad, &s.legacy, err)
		return
	}
	// Counted before the hand-over, as the real subscribers count it, so
	// that a reader that has an event finds it counted.
	s.received.Add(uint64(len(evs)))
	s.messages.Add(1)
	handed()
	select {
	case s.out <- evs:
	case <-s.quit:
	case <-pubQuit:
	}
}

// Close unsubscribes, then closes Events once no publisher is handing an
// event over.
func (s *inmemSub) Close() error {
	s.once.Do(func() {
		s.n.mu.Lock()
		for ep, subs := range s.n.subs {
			for i, x := range subs {
				if x == s {
					s.n.subs[ep] = append(subs[:i:i], subs[i+1:]...)
					break
				}
			}
		}
		s.n.mu.Unlock()
		close(s.quit)
		s.mu.Lock()
		s.closed = true
		close(s.out)
		s.mu.Unlock()
	})
	s.links.untrack(s)
	return nil
}
