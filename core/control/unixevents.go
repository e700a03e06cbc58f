package control

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/internal/due"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Readiness events to a same-host scheduler skip libzmq too: the shard's
// publisher also listens on the abstract Unix name of its ZeroMQ endpoint
// (UnixName), admits subscribers as the control path admits callers
// (SO_PEERCRED uid, then the secret's challenge–response), and writes
// each event, behind its length (unixframe.go), to every admitted
// subscriber: from Send itself when the socket takes it without waiting,
// else from a goroutine of that connection, parked in Go's network poller
// with a deadline. The contract of events is ZeroMQ's:
//
//   - One seq per event across both paths, so that a subscriber sees seq
//     rise by one per event unless some were dropped; events of one
//     publisher arrive in their order on either path. An event goes over
//     Unix while a Unix subscriber is admitted, else over ZeroMQ; a
//     scheduler follows one publisher over one path (a Unix subscription
//     that fails goes over ZeroMQ for the life of that endpoint), so it
//     never sees two paths race.
//   - While no Unix subscriber is there the publisher holds the last
//     opts.eventQueue events, as a PUSH socket holds them for a PULL yet
//     to connect, and a subscriber admitted later reads them first.
//   - A subscriber's queue is bounded: a full one drops the event,
//     counted (PubStats.Dropped), and the gap in seq (SubStats.Gaps)
//     is covered by the scheduler's status resync, as a gap over ZeroMQ.
//   - A write has a deadline: a subscriber that stops reading loses its
//     connection (PubStats.WriteFailures), not the publisher's time, and
//     redials; a restarted shard is followed on its new endpoint, as over
//     ZeroMQ, and an old name is redialled until the subscriber closes.

// unixEventBatch bounds the bytes of queued frames written at once.
const unixEventBatch = 256 << 10

// unixRedialMax caps the back-off between redials of a lost subscription.
const unixRedialMax = time.Second

// UnixEventPub publishes a shard's events to same-host subscribers on an
// abstract Unix socket and, while none is admitted, to the ZeroMQ
// publisher beside it. Send never blocks.
type UnixEventPub struct {
	gate *unixGate
	zmq  *EventPub // nil: Unix alone (tests)
	opt  unixOptions
	log  *slog.Logger

	// mu orders seq with every queue, and guards what follows.
	mu            sync.Mutex
	seq           uint64
	subs          map[*unixEventConn]struct{} // admitted
	backlog       []unixPending               // while no subscriber; at most opt.eventQueue events
	backlogEvents int
	closed        bool

	sent, messages, dropped, invalid, writeFailures atomic.Uint64
}

type unixEventConn struct {
	c   *net.UnixConn
	raw syscall.RawConn
	q   chan unixPending
	// queued counts the events in q, at most opt.eventQueue: the bound is
	// in events however they are packed into messages.
	queued atomic.Int64
	// busy, under the publisher's mu: the writer holds or writes bytes of
	// this connection, so Send must queue behind them; false only while q
	// is empty.
	busy bool
}

// unixPending is bytes of framed event messages queued for a writer;
// events is how many events end in them.
type unixPending struct {
	b      []byte
	events int
}

// tryWrite writes as much of b as the socket takes without waiting; an
// error means the connection is broken.
func (sc *unixEventConn) tryWrite(b []byte) (int, error) {
	var n int
	var werr error
	if err := sc.raw.Write(func(fd uintptr) bool {
		n, werr = syscall.SendmsgN(int(fd), b, nil, nil, syscall.MSG_DONTWAIT|syscall.MSG_NOSIGNAL)
		return true // one attempt: never wait for room here
	}); err != nil {
		return 0, err
	}
	if errors.Is(werr, syscall.EAGAIN) || errors.Is(werr, syscall.EINTR) {
		return 0, nil
	}
	if werr != nil {
		return 0, werr
	}
	return n, nil
}

var _ Publisher = (*UnixEventPub)(nil)

// listenUnixEvents publishes on the abstract name, beside zp when given.
func listenUnixEvents(name string, zp *EventPub, sec Security, log *slog.Logger, opt unixOptions) (*UnixEventPub, error) {
	if err := abstractName("unix events", name); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	opt = opt.withDefaults()
	p := &UnixEventPub{zmq: zp, opt: opt, log: log, subs: map[*unixEventConn]struct{}{}}
	g, err := listenUnixGate(name, "unix event subscriber", sec, log, opt, p.serveConn)
	if err != nil {
		return nil, fmt.Errorf("control: unix events listen %s: %w", name, err)
	}
	p.gate = g
	return p, nil
}

// Endpoint is the ZeroMQ endpoint that subscribers are given (a same-host
// one derives this publisher's name from it), or the name without one.
func (p *UnixEventPub) Endpoint() string {
	if p.zmq != nil {
		return p.zmq.Endpoint()
	}
	return p.gate.name
}

// UnixEndpoint is the abstract name served.
func (p *UnixEventPub) UnixEndpoint() string { return p.gate.name }

// Send has Publisher's contract.
func (p *UnixEventPub) Send(evs ...wire.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range stampEvents(evs, &p.seq, p.refuseEvent) {
		p.sendLocked(m)
	}
}

func (p *UnixEventPub) refuseEvent(ev wire.Event, err error) {
	p.invalid.Add(1)
	p.log.Error("control: event refused", "transfer_id", ev.TransferID, "err", err)
}

// sendLocked offers one message to every admitted subscriber, or, while
// none is, to ZeroMQ and the backlog.
func (p *UnixEventPub) sendLocked(m eventMsg) {
	framed := unixPending{b: appendFrameTo(nil, m.frame), events: m.events}
	if len(p.subs) > 0 {
		for sc := range p.subs {
			p.offerLocked(sc, framed)
		}
		return
	}
	if p.zmq != nil {
		p.zmq.enqueueLocked(m)
	}
	if m.events > p.opt.eventQueue { // cannot be with the defaults
		if p.zmq == nil {
			p.dropped.Add(uint64(m.events))
		}
		return
	}
	for p.backlogEvents+m.events > p.opt.eventQueue {
		// The oldest go, as a full PUSH queue would drop the newest: the
		// seq gap is the same to a subscriber, and the latest are the likeliest
		// to be awaited.
		if p.zmq == nil {
			p.dropped.Add(uint64(p.backlog[0].events))
		}
		p.backlogEvents -= p.backlog[0].events
		p.backlog = p.backlog[1:]
	}
	p.backlog = append(p.backlog, framed)
	p.backlogEvents += m.events
}

// offerLocked hands one framed message to a subscriber: written at once
// when its connection has nothing queued and the socket takes it whole
// without waiting (no goroutine hand-off on the common path), else
// queued for its writer, or dropped and counted when the queue is full.
func (p *UnixEventPub) offerLocked(sc *unixEventConn, framed unixPending) {
	if !sc.busy {
		n, err := sc.tryWrite(framed.b)
		switch {
		case err != nil:
			// The connection is broken; its goroutines see it and clean up.
			sc.busy = true
			_ = sc.c.Close()
			p.writeFailures.Add(1)
			metrics.Failed("control", "unix_event_write")
			p.log.Warn("control: unix event write failed; closing the subscriber's connection", "name", p.gate.name, "err", err)
			return
		case n == len(framed.b):
			p.sent.Add(uint64(framed.events))
			p.messages.Add(1)
			return
		}
		// The socket took part or none: the writer, with its deadline,
		// sends the rest. The queue is empty while not busy.
		sc.busy = true
		sc.queued.Add(int64(framed.events))
		sc.q <- unixPending{b: framed.b[n:], events: framed.events}
		return
	}
	if !reserveEvents(&sc.queued, framed.events, p.opt.eventQueue) {
		p.dropped.Add(uint64(framed.events))
		return
	}
	select {
	case sc.q <- framed:
	default: // cannot be: q holds opt.eventQueue messages of one event or more
		sc.queued.Sub(int64(framed.events))
		p.dropped.Add(uint64(framed.events))
	}
}

// Stats adds the ZeroMQ publisher's counters to this path's.
func (p *UnixEventPub) Stats() PubStats {
	var st PubStats
	if p.zmq != nil {
		st = p.zmq.Stats()
	}
	st.Sent += p.sent.Load()
	st.Messages += p.messages.Load()
	st.SentUnix = p.sent.Load()
	st.Dropped += p.dropped.Load()
	st.Invalid += p.invalid.Load()
	st.WriteFailures = p.writeFailures.Load()
	st.Refused = addCounts(st.Refused, p.gate.refusals())
	return st
}

// Close stops listening, closes every subscriber's connection, then the
// ZeroMQ publisher. Idempotent.
func (p *UnixEventPub) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.gate.close()
	if p.zmq != nil {
		return p.zmq.Close()
	}
	return nil
}

// serveConn hands an admitted subscriber the backlog and writes its
// queue until the connection fails or the publisher closes.
func (p *UnixEventPub) serveConn(c *net.UnixConn, _ uint32) {
	sc := &unixEventConn{c: c, q: make(chan unixPending, p.opt.eventQueue)}
	defer func() {
		p.mu.Lock()
		delete(p.subs, sc)
		p.mu.Unlock()
	}()
	_ = c.SetDeadline(time.Time{})
	raw, err := c.SyscallConn()
	if err != nil {
		p.log.Warn("control: unix event connection", "name", p.gate.name, "err", err)
		return
	}
	sc.raw = raw
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	for _, f := range p.backlog {
		sc.queued.Add(int64(f.events))
		sc.q <- f // the backlog holds no more events, so no more messages, than the queue
	}
	sc.busy = len(p.backlog) > 0
	p.backlog, p.backlogEvents = nil, 0
	p.subs[sc] = struct{}{}
	p.mu.Unlock()

	// A subscriber sends nothing after its handshake: a byte or the end of
	// the stream both end the connection, and the write loop with it.
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		var b [1]byte
		_, _ = c.Read(b[:])
		_ = c.Close()
	}()
	defer func() { <-gone }()
	var out []byte
	for {
		var it unixPending
		select {
		case it = <-sc.q:
		case <-gone:
			return
		}
		sc.queued.Sub(int64(it.events))
		out = append(out[:0], it.b...)
		n, msgs := it.events, 1
	more:
		for len(out) < unixEventBatch {
			select {
			case it = <-sc.q:
				sc.queued.Sub(int64(it.events))
				out = append(out, it.b...)
				n += it.events
				msgs++
			default:
				break more
			}
		}
		_ = c.SetWriteDeadline(time.Now().Add(p.opt.writeTimeout))
		if _, err := c.Write(out); err != nil {
			p.writeFailures.Add(1)
			metrics.Failed("control", "unix_event_write")
			p.log.Warn("control: unix event subscriber not reading; closing its connection", "name", p.gate.name, "err", err)
			_ = c.Close()
			return
		}
		p.sent.Add(uint64(n))
		p.messages.Add(uint64(msgs))
		p.mu.Lock()
		if len(sc.q) == 0 {
			sc.busy = false
		}
		p.mu.Unlock()
	}
}

// appendFrameTo appends a frame that stampEvents encoded, so within the
// cap, behind its length.
func appendFrameTo(b, f []byte) []byte {
	out, err := appendUnixFrame(b, f)
	if err != nil {
		return b // cannot be: EncodeEvents bounds it
	}
	return out
}

// UnixEventSub follows same-host publishers over their Unix names and the
// others, and those it could not reach so, over the ZeroMQ subscriber it
// wraps; Events merges both, unless Direct sends the Unix path's events
// to a function of the caller's.
type UnixEventSub struct {
	zmq  Subscriber // nil: Unix alone (tests)
	key  []byte
	opt  unixOptions
	log  *slog.Logger
	fell func(cause string) // counts a fallback to ZeroMQ; may be nil

	out  chan []wire.Event
	quit chan struct{}
	// direct, when set (before the first Connect), takes the Unix path's
	// events instead of out.
	direct func([]wire.Event)

	mu      sync.Mutex
	follows map[string]*unixFollow // by connect endpoint
	polled  []*unixFollow          // follows' values, for Poll without a map walk
	onZMQ   map[string]bool        // endpoints followed over ZeroMQ
	closed  bool
	wg      sync.WaitGroup

	received, messages, bad, legacy, gaps, redials atomic.Uint64
}

type unixFollow struct {
	name string
	mu   sync.Mutex
	c    *net.UnixConn // the live connection; nil while redialling
	rc   syscall.RawConn

	// in guards the stream's reading and delivery, which the reader
	// goroutine and Poll take turns at: the bytes read and not yet framed,
	// the seq of the last event (0 before the first; a redial keeps it),
	// and a read error that Poll met and the reader must act on.
	in   sync.Mutex
	buf  []byte
	last uint64
	err  error
}

var (
	_ Subscriber = (*UnixEventSub)(nil)
	_ Poller     = (*UnixEventSub)(nil)
)

// unixReadChunk is the most the reader asks of the socket at a time; a
// frame longer than what is buffered grows the buffer to the frame's
// length, which the header check bounds by wire.MaxMessage.
const unixReadChunk = 64 << 10

func newUnixEventSub(zs Subscriber, sec Security, log *slog.Logger, opt unixOptions, fell func(string)) *UnixEventSub {
	if log == nil {
		log = slog.Default()
	}
	s := &UnixEventSub{
		zmq: zs, key: unixKey(sec), opt: opt, log: log, fell: fell,
		out: make(chan []wire.Event, EventQueue), quit: make(chan struct{}),
		follows: map[string]*unixFollow{}, onZMQ: map[string]bool{},
	}
	if zs != nil {
		s.wg.Add(1)
		go s.forward()
	}
	return s
}

// forward hands the ZeroMQ subscriber's events on.
func (s *UnixEventSub) forward() {
	defer s.wg.Done()
	for evs := range s.zmq.Events() {
		select {
		case s.out <- evs:
		case <-s.quit:
			return
		}
	}
}

// Direct implements Poller.
func (s *UnixEventSub) Direct(fn func([]wire.Event)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.direct = fn
}

// Poll implements Poller: for each publisher followed over Unix whose
// reader is not delivering, it reads what the socket holds without
// waiting and delivers its whole frames.
func (s *UnixEventSub) Poll() int {
	s.mu.Lock()
	fs, direct := s.polled, s.direct
	s.mu.Unlock()
	if direct == nil {
		return 0
	}
	n := 0
	for _, f := range fs {
		n += s.pollFollow(f)
	}
	return n
}

func (s *UnixEventSub) pollFollow(f *unixFollow) int {
	if !f.in.TryLock() {
		return 0 // the reader is at it
	}
	defer f.in.Unlock()
	f.mu.Lock()
	c, rc := f.c, f.rc
	f.mu.Unlock()
	if c == nil || f.err != nil {
		return 0
	}
	n := 0
	// Control holds a reference to the descriptor, not the read lock the
	// reader waits under, so it runs beside a reader parked in the poller.
	cerr := rc.Control(func(fd uintptr) {
		n, f.err = s.pull(f, int(fd))
	})
	_ = cerr // closed meanwhile: the reader redials
	if f.err != nil {
		// After Control: Close waits for every reference to the
		// descriptor, Control's own included. The reader, woken by the
		// close, acts on the error: it owns the connection's end and the
		// redial.
		_ = c.Close()
	}
	return n
}

// pull reads what fd holds without waiting and delivers its whole frames;
// it returns the number of events delivered, and an error when the
// stream ended or is not ours. Called with f.in held.
func (s *UnixEventSub) pull(f *unixFollow, fd int) (int, error) {
	delivered := 0
	for {
		if len(f.buf) == cap(f.buf) {
			f.buf = slices.Grow(f.buf, unixReadChunk)
		}
		free := f.buf[len(f.buf):cap(f.buf)]
		n, err := syscall.Read(fd, free)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return delivered, nil
		case err != nil:
			return delivered, fmt.Errorf("control: unix events read: %w", err)
		case n == 0:
			return delivered, io.EOF
		}
		f.buf = f.buf[:len(f.buf)+n]
		m, err := s.deliverFrames(f)
		delivered += m
		if err != nil {
			return delivered, err
		}
	}
}

// deliverFrames delivers the whole frames at the front of f.buf and keeps
// the rest, growing the buffer to hold a frame whose header came in.
func (s *UnixEventSub) deliverFrames(f *unixFollow) (int, error) {
	delivered := 0
	rest := f.buf
	for {
		frame, after, ok, err := decodeUnixFrame(rest)
		if err != nil {
			return delivered, err
		}
		if !ok {
			break
		}
		rest = after
		delivered += s.deliver(f, frame)
	}
	keep := copy(f.buf, rest)
	f.buf = f.buf[:keep]
	if keep >= unixFrameHeader {
		if n, err := unixFrameLen(f.buf); err == nil && cap(f.buf) < unixFrameHeader+n {
			f.buf = slices.Grow(f.buf, unixFrameHeader+n-keep)
		}
	}
	if cap(f.buf) > unixReadChunk && len(f.buf) == 0 {
		f.buf = nil // a long frame's buffer goes with it
	}
	return delivered, nil
}

// deliver decodes one frame and hands its events on; it returns how many.
func (s *UnixEventSub) deliver(f *unixFollow, frame []byte) int {
	evs, err := wire.DecodeEvents(frame)
	if err != nil {
		badEvent(s.log, &s.bad, &s.legacy, err)
		return 0
	}
	// A seq at or below the last starts again: a new incarnation on the
	// same name, no gap. The seqs of one message run without a hole.
	if first := evs[0].Seq; f.last != 0 && first > f.last+1 {
		s.gaps.Add(first - f.last - 1)
	}
	f.last = evs[len(evs)-1].Seq
	s.received.Add(uint64(len(evs)))
	s.messages.Add(1)
	if s.direct != nil {
		s.direct(evs)
		return len(evs)
	}
	select {
	case s.out <- evs:
	case <-s.quit:
	}
	return len(evs)
}

// Connect follows the publisher of endpoint: over its Unix name when it
// is of this host and admits this end, else over ZeroMQ. Unlike ZeroMQ's
// Connect it waits for a same-host publisher's admission (at most
// unixHandshakeTimeout), so that a refusal turns to ZeroMQ at once.
func (s *UnixEventSub) Connect(endpoint string) error {
	name, target := endpoint, endpoint // an abstract name, given as such
	if !strings.HasPrefix(endpoint, "@") {
		var err error
		if target, err = connectEndpoint(endpoint); err != nil {
			return err
		}
		name = ""
		if host, _, _ := SplitEndpoint(target); isLocalHost(host) {
			name, _ = UnixName(target)
		}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("control: connect events %s: %w", endpoint, ErrClosed)
	}
	_, following := s.follows[target]
	viaZMQ := name == "" || s.onZMQ[target]
	s.mu.Unlock()
	if following {
		return nil
	}
	if viaZMQ {
		return s.connectZMQ(endpoint)
	}
	c, err := s.dial(name)
	if err != nil {
		cause := unixCause(err)
		s.log.Warn("control: unix events of a same-host shard unreachable; following over ZeroMQ", "name", name, "cause", cause, "err", err)
		if s.fell != nil {
			s.fell(cause)
		}
		s.mu.Lock()
		s.onZMQ[target] = true
		s.mu.Unlock()
		return s.connectZMQ(endpoint)
	}
	f := &unixFollow{name: name}
	if err := f.attach(c); err != nil {
		_ = c.Close()
		return fmt.Errorf("control: connect events %s: %w", endpoint, err)
	}
	s.mu.Lock()
	if _, dup := s.follows[target]; dup || s.closed {
		closed := s.closed
		s.mu.Unlock()
		_ = c.Close()
		if closed {
			return fmt.Errorf("control: connect events %s: %w", endpoint, ErrClosed)
		}
		return nil
	}
	s.follows[target] = f
	s.polled = append(s.polled, f)
	s.wg.Add(1)
	s.mu.Unlock()
	go s.read(f)
	return nil
}

// attach makes c the follow's live connection.
func (f *unixFollow) attach(c *net.UnixConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.c, f.rc = c, rc
	f.mu.Unlock()
	return nil
}

func (s *UnixEventSub) connectZMQ(endpoint string) error {
	if s.zmq == nil {
		return fmt.Errorf("control: connect events %s: no ZeroMQ subscriber: %w", endpoint, errUnixUnreachable)
	}
	return s.zmq.Connect(endpoint)
}

// dial connects to and is admitted by the publisher on name.
func (s *UnixEventSub) dial(name string) (*net.UnixConn, error) {
	c, err := dialAdmitted(context.Background(), name, s.key, s.opt.allowed)
	if err != nil {
		return nil, fmt.Errorf("control: unix events %s: %w", name, err)
	}
	return c, nil
}

// read delivers one publisher's events, redialling its name when the
// connection is lost, until the subscriber closes.
func (s *UnixEventSub) read(f *unixFollow) {
	defer s.wg.Done()
	backoff := 50 * time.Millisecond
	for {
		f.mu.Lock()
		c, rc := f.c, f.rc
		f.mu.Unlock()
		if c != nil {
			err := s.readConn(f, rc)
			_ = c.Close()
			if s.quitting() {
				return
			}
			s.log.Info("control: unix event subscription lost; redialling", "name", f.name, "err", err)
			f.in.Lock()
			f.mu.Lock()
			f.c, f.rc = nil, nil
			f.mu.Unlock()
			f.buf, f.err = f.buf[:0], nil // a new stream starts at a frame
			f.in.Unlock()
			backoff = 50 * time.Millisecond
		}
		if !due.Sleep(s.quit, backoff) {
			return
		}
		backoff = min(2*backoff, unixRedialMax)
		nc, err := s.dial(f.name)
		if err != nil {
			continue
		}
		if err := f.attach(nc); err != nil {
			_ = nc.Close()
			continue
		}
		s.redials.Add(1)
		if s.quitting() { // Close may have missed it
			_ = nc.Close()
			return
		}
	}
}

// readConn reads and delivers frames until the connection fails, taking
// turns with Poll: each time the socket turns readable it takes f.in and
// reads what is there, or finds that Poll took it first.
func (s *UnixEventSub) readConn(f *unixFollow, rc syscall.RawConn) error {
	var failed error
	err := rc.Read(func(fd uintptr) bool {
		f.in.Lock()
		defer f.in.Unlock()
		if f.err != nil { // Poll met the end first
			failed = f.err
			return true
		}
		if _, err := s.pull(f, int(fd)); err != nil {
			failed = err
			return true
		}
		if s.quitting() {
			failed = ErrClosed
			return true
		}
		return false // nothing more there: wait for the socket
	})
	if failed != nil {
		return failed
	}
	f.in.Lock()
	defer f.in.Unlock()
	if f.err != nil { // Poll met the end and closed the connection
		return f.err
	}
	return err
}

func (s *UnixEventSub) quitting() bool { return isClosed(s.quit) }

// Events has Subscriber's contract.
func (s *UnixEventSub) Events() <-chan []wire.Event { return s.out }

// Stats adds this path's counters to the ZeroMQ subscriber's.
func (s *UnixEventSub) Stats() SubStats {
	var st SubStats
	if s.zmq != nil {
		st = s.zmq.Stats()
		st.Refused = maps.Clone(st.Refused)
	}
	st.Received += s.received.Load()
	st.ReceivedUnix = s.received.Load()
	st.Messages += s.messages.Load()
	st.Bad += s.bad.Load()
	st.Legacy += s.legacy.Load()
	st.Gaps += s.gaps.Load()
	st.Redials = s.redials.Load()
	return st
}

// Close stops every follow, closes the ZeroMQ subscriber and then Events.
// Idempotent.
func (s *UnixEventSub) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.quit)
	for _, f := range s.polled {
		f.mu.Lock()
		if f.c != nil {
			_ = f.c.Close()
		}
		f.mu.Unlock()
	}
	s.mu.Unlock()
	var err error
	if s.zmq != nil {
		err = s.zmq.Close()
	}
	s.wg.Wait()
	close(s.out)
	if err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	return nil
}
