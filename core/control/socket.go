package control

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

var (
	// ErrClosed: the object was closed; calls in flight fail with it.
	ErrClosed = errors.New("control: closed")
	// ErrStopped: the socket's goroutine stopped on its own (a panic, a
	// terminated context); the object is unusable and should be closed.
	ErrStopped = errors.New("control: socket goroutine stopped")
	// ErrBadEndpoint: an endpoint that is not tcp://host:port.
	ErrBadEndpoint = errors.New("bad endpoint")
)

const (
	// pollTimeout bounds every poll. Work never waits for it (queued work
	// wakes the owner at once); it only bounds how long an owner takes to
	// notice a call that gave up while its frame was stuck behind a full or
	// unconnected socket.
	pollTimeout = 250 * time.Millisecond
	// ioTimeout is the socket-level receive/send timeout: every receive
	// and send is non-blocking after a poll, so this is a safety net.
	ioTimeout = time.Second
	// maxFrame caps what libzmq accepts in one frame: frames between
	// wire.MaxMessage and this are read and refused with too_large; a peer
	// sending more is disconnected unread, which bounds memory.
	maxFrame = 2 * wire.MaxMessage
	// recvBatch bounds how many messages an owner handles per wake-up so a
	// busy peer cannot starve Close or the other socket.
	recvBatch = 256
	// maxParts and maxMessage cap a whole multipart message, where
	// maxFrame (ZMQ_MAXMSGSIZE) caps only each part: a ROUTER's request is
	// the caller's identity and one frame, so a few parts leave room to
	// answer a malformed request with its id, and anything more is read
	// part by part and dropped, never kept.
	maxParts   = 4
	maxMessage = maxFrame + 1024
)

// newSocket opens a socket with the settings every control socket shares.
func newSocket(zctx *zmq.Context, t zmq.Type) (*zmq.Socket, error) {
	s, err := zctx.NewSocket(t)
	if err != nil {
		return nil, fmt.Errorf("control: new %v socket: %w", t, err)
	}
	for _, set := range []func() error{
		// Linger 0: Close and context termination never wait on peers.
		func() error { return s.SetLinger(0) },
		func() error { return s.SetIpv6(true) },
		func() error { return s.SetRcvtimeo(ioTimeout) },
		func() error { return s.SetSndtimeo(ioTimeout) },
		func() error { return s.SetMaxmsgsize(maxFrame) },
	} {
		if err := set(); err != nil {
			s.Close()
			return nil, fmt.Errorf("control: configure %v socket: %w", t, err)
		}
	}
	return s, nil
}

// capped is one message as recvCapped kept it.
type capped struct {
	parts [][]byte // all of them, or only the first once over the cap
	over  bool     // more than maxParts parts or maxMessage bytes: dropped
	held  int      // the most bytes kept at any moment
}

// recvCapped reads one message part by part, keeping at most maxParts
// parts and maxMessage bytes. Past either cap it keeps only the first
// part (a ROUTER's caller identity, needed to answer) and reads the rest
// into nothing, so what this process holds of a message is bounded
// whatever its number of parts. libzmq delivers a message only once all
// its parts have arrived, so the parts after the first never block.
func recvCapped(s *zmq.Socket) (capped, error) {
	first, err := s.RecvBytes(zmq.DONTWAIT)
	if err != nil {
		return capped{}, err
	}
	m := capped{parts: [][]byte{first}, held: len(first)}
	total := len(first)
	for {
		more, err := s.GetRcvmore()
		if err != nil {
			return m, fmt.Errorf("receive: %w", err)
		}
		if !more {
			return m, nil
		}
		part, err := s.RecvBytes(zmq.DONTWAIT)
		if err != nil {
			return m, fmt.Errorf("receive part %d: %w", len(m.parts), err)
		}
		if m.over {
			continue
		}
		total += len(part)
		if len(m.parts) == maxParts || total > maxMessage {
			m.over = true
			m.parts = m.parts[:1]
			continue
		}
		m.parts = append(m.parts, part)
		m.held = total
	}
}

func isAgain(err error) bool { return zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) }

func isTerm(err error) bool { return zmq.AsErrno(err) == zmq.ETERM }

var wakeSeq atomic.Uint64

// waker lets any goroutine wake a socket's owner out of its poll.
//
// The owner polls rx together with its real socket. Other goroutines put
// their work on a Go channel and then call wake, which sends one byte on tx.
// tx is the only socket touched by more than one goroutine, and only under
// mu: libzmq allows a socket to move between threads provided a full memory
// barrier separates its uses, and a mutex hand-off is one. rx is the owner's
// alone.
//
// armed coalesces wake-ups: at most one byte is in flight, however many
// callers queue work, and the owner disarms before draining its channels,
// so work queued after the drain always re-arms and sends a fresh byte.
type waker struct {
	rx    *zmq.Socket
	mu    sync.Mutex
	tx    *zmq.Socket // guarded by mu; nil once closed
	armed atomic.Bool
}

func newWaker(zctx *zmq.Context) (*waker, error) {
	addr := fmt.Sprintf("inproc://ecmooncake-wake-%d", wakeSeq.Add(1))
	rx, err := newSocket(zctx, zmq.PULL)
	if err != nil {
		return nil, err
	}
	if err := rx.Bind(addr); err != nil {
		rx.Close()
		return nil, fmt.Errorf("control: bind %s: %w", addr, err)
	}
	tx, err := newSocket(zctx, zmq.PUSH)
	if err != nil {
		rx.Close()
		return nil, err
	}
	if err := tx.Connect(addr); err != nil {
		rx.Close()
		tx.Close()
		return nil, fmt.Errorf("control: connect %s: %w", addr, err)
	}
	return &waker{rx: rx, tx: tx}, nil
}

// wake makes the owner's next (or current) poll return. Any goroutine.
func (w *waker) wake() {
	if !w.armed.CompareAndSwap(false, true) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.tx == nil {
		return
	}
	if _, err := w.tx.SendBytes([]byte{1}, zmq.DONTWAIT); err != nil {
		// Nothing is in flight, so the next wake must try again.
		w.armed.Store(false)
	}
}

// drain consumes pending wake-ups. Owner only; call before draining the
// work channels.
func (w *waker) drain() {
	for {
		if _, err := w.rx.RecvBytes(zmq.DONTWAIT); err != nil {
			break
		}
	}
	w.armed.Store(false)
}

// closeTx closes the write side. Idempotent; call once the owner is gone.
func (w *waker) closeTx() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.tx != nil {
		w.tx.Close()
		w.tx = nil
	}
}

// owner is the life cycle shared by every socket-owning goroutine: a quit
// signal, a done signal, and the reason it stopped.
type owner struct {
	log  *slog.Logger
	name string
	wake *waker
	quit chan struct{}
	done chan struct{}
	once sync.Once
	err  error // why the goroutine stopped; written before done closes
}

func newOwner(log *slog.Logger, name string, w *waker) *owner {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &owner{log: log, name: name, wake: w, quit: make(chan struct{}), done: make(chan struct{})}
}

// run runs body on the calling goroutine until it returns or panics, then
// closes the owner's sockets and publishes why it stopped. A panic is
// logged and becomes ErrStopped for everyone waiting: it never reaches the
// process.
func (o *owner) run(body func() error, sockets ...*zmq.Socket) {
	defer close(o.done)
	defer func() {
		for _, s := range append(sockets, o.wake.rx) {
			s.Close()
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			o.log.Error("control: socket goroutine panicked", "socket", o.name, "panic", r, "stack", string(debug.Stack()))
			o.err = fmt.Errorf("%w: %s: panic: %v", ErrStopped, o.name, r)
		}
	}()
	if err := body(); err != nil {
		o.log.Error("control: socket goroutine stopped", "socket", o.name, "err", err)
		o.err = fmt.Errorf("%w: %s: %w", ErrStopped, o.name, err)
		return
	}
	o.err = ErrClosed
}

// quitting reports whether stop was asked. Owner only.
func (o *owner) quitting() bool {
	select {
	case <-o.quit:
		return true
	default:
		return false
	}
}

// stop asks the owner to finish, waits for it, and closes the wake-up
// write side. Idempotent, any goroutine.
func (o *owner) stop() {
	o.once.Do(func() {
		close(o.quit)
		o.wake.wake()
	})
	<-o.done
	o.wake.closeTx()
}

// stopped returns why the owner stopped; valid once done is closed.
func (o *owner) stopped() error {
	<-o.done
	return o.err
}

// poll waits on p for at most pollTimeout.
func poll(p *zmq.Poller) ([]zmq.Polled, error) {
	polled, err := p.Poll(pollTimeout)
	if err != nil {
		return nil, fmt.Errorf("poll: %w", err)
	}
	return polled, nil
}
