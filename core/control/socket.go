package control

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"
	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

var (
	// ErrClosed: the object was closed; calls in flight fail with it.
	ErrClosed = errors.New("control: closed")
	// ErrStopped: the socket's goroutine stopped on its own (a panic, a
	// terminated context); the object is unusable and should be closed.
	ErrStopped = errors.New("control: socket goroutine stopped")
)

// tickInterval is how often a parked owner wakes with nothing to do.
// Work never waits for it (a socket's signal or queued work wakes the
// owner at once); it clocks reconnects on a backoff and bounds how long a
// signal lost to a bug would go unseen. A variable so that a test can
// take the net away; read by owners only, set before they start.
var tickInterval = 250 * time.Millisecond

const (
	// ioTimeout is the socket-level receive/send timeout: every receive
	// and send of an owner is non-blocking, so this is a safety net.
	ioTimeout = time.Second
	// maxFrame caps what libzmq accepts in one frame (ZMQ_MAXMSGSIZE),
	// checked at the frame's header, before libzmq allocates it: a peer
	// announcing more is disconnected unread. No control message is larger
	// than wire.MaxMessage (every encoder refuses more; data rides the
	// data planes), so the cap is that and a margin, in which a frame is
	// read and refused with too_large, so that a peer a little over the
	// limit learns why. At twice wire.MaxMessage, one message of 16 parts
	// of 30 MiB grew a shard by 447 MB before any check.
	maxFrame = wire.MaxMessage + 64<<10
	// recvBatch bounds how many messages an owner handles per step so a
	// busy peer cannot starve Close or the other socket.
	recvBatch = 256
	// maxParts and maxMessage cap a whole multipart message, where
	// maxFrame (ZMQ_MAXMSGSIZE) caps only each part: a ROUTER's request is
	// the caller's identity and one frame, so a few parts leave room to
	// answer a malformed request with its id, and anything more is read
	// part by part and dropped, never kept.
	maxParts   = 4
	maxMessage = maxFrame + 1024
	// handshakeTimeout is ZMQ_HANDSHAKE_IVL: a connection that has not
	// completed its security handshake by then is closed. libzmq's default
	// of 30 s let a silent peer hold a descriptor that long; a CURVE
	// handshake on loopback or a LAN takes milliseconds, so 5 s leaves a
	// loaded host plenty.
	handshakeTimeout = 5 * time.Second
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
		func() error { return s.SetHandshakeIvl(handshakeTimeout) },
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

// pollItem is a socket an owner polls: what it does with it on each step,
// and what it waits for on it.
type pollItem struct {
	sock *zmq.Socket
	// serve does what the socket allows without blocking: reads until
	// EAGAIN (or a batch), sends what is queued. Owner only.
	serve func() error
	// want is the events the owner has work for (POLLIN to read,
	// POLLOUT while a frame waits for room); nil means POLLIN.
	want func() zmq.State
}

func (it pollItem) wants() zmq.State {
	if it.want == nil {
		return zmq.POLLIN
	}
	return it.want()
}

// monitor is a socket monitor an owner reads beside its socket: read
// hands on every queued event until EAGAIN or a batch, and reports
// whether it stopped at the batch (full). Owner only.
type monitor struct {
	sock *zmq.Socket
	read func() (full bool)
}

// watched is a monitor with the watcher's view of it.
type watched struct {
	monitor
	fd        *os.File    // a duplicate of its ZMQ_FD, for the poller
	signalled atomic.Bool // set by the watcher, cleared by the owner
}

// owner is the goroutine that owns a set of sockets, and the one loop
// every such goroutine runs: serve every socket (a step), and when no
// socket has more work, park until something happens.
//
// It parks in Go, never in libzmq. Each socket's ZMQ_FD (the descriptor
// libzmq signals whenever the socket's state may have changed) is watched
// by Go's network poller: the owner's socket's by the owner itself, which
// steps on the goroutine the poller wakes; a monitor's by a watcher
// goroutine, which marks it signalled and wakes the owner. Work queued by
// other goroutines wakes the owner by expiring the read deadline of its
// wait. A goroutine blocked in a cgo
// zmq_poll instead keeps its OS thread and, until the runtime retakes it,
// its P: with GOMAXPROCS 2 a few such owners leave no P for the goroutines
// they ready, which then wait for the runtime's monitor; and each hand-off
// between goroutines costs a wake-up of another thread.
//
// ZMQ_FD is edge-triggered: libzmq signals it when it queues a command for
// the socket, and only once the socket has processed every earlier one.
// So before parking the loop reads ZMQ_EVENTS of its socket (which
// processes all queued commands) and steps again at once while it has
// work; a command queued after that signals afresh. A monitor is only
// read, until EAGAIN, which processes its commands too; it is read when
// signalled, so a quiet one costs nothing.
type owner struct {
	log  *slog.Logger
	name string
	item pollItem
	fd   *os.File // a duplicate of item's ZMQ_FD, for the poller
	mons []*watched
	// poked coalesces wake-ups: set by the first wakeup after the owner
	// last looked for work, which is the one that expires the deadline.
	poked atomic.Bool
	quit  chan struct{}
	done  chan struct{}
	once  sync.Once
	err   error // why the goroutine stopped; written before done closes
	// onExit, when set before start, runs on the goroutine as it ends,
	// after the sockets are closed.
	onExit func()
}

// aLongTimeAgo is a deadline that has passed: setting it wakes a wait.
var aLongTimeAgo = time.Unix(1, 0)

// newOwner prepares the owner of item's socket and of the monitors; start
// runs it. On error the sockets are left to the caller.
func newOwner(log *slog.Logger, name string, item pollItem, mons ...monitor) (*owner, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := &owner{log: log, name: name, item: item, quit: make(chan struct{}), done: make(chan struct{})}
	var err error
	if o.fd, err = watchable(item.sock); err != nil {
		return nil, fmt.Errorf("control: %s: %w", name, err)
	}
	for _, m := range mons {
		w := &watched{monitor: m}
		if w.fd, err = watchable(m.sock); err != nil {
			o.closeFDs()
			return nil, fmt.Errorf("control: %s: %w", name, err)
		}
		o.mons = append(o.mons, w)
	}
	return o, nil
}

// watchable returns a duplicate of sock's ZMQ_FD registered with Go's
// network poller. Nothing reads it: libzmq alone consumes its signals, the
// poller only reports them. The duplicate shares libzmq's file flags, so
// nothing may call its Fd method, which would make both blocking.
func watchable(sock *zmq.Socket) (*os.File, error) {
	fd, err := sock.GetFd()
	if err != nil {
		return nil, fmt.Errorf("ZMQ_FD: %w", err)
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup ZMQ_FD: %w", err)
	}
	// libzmq's descriptor is non-blocking, so os.NewFile registers it.
	f := os.NewFile(uintptr(dup), "zmq-fd")
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, fmt.Errorf("ZMQ_FD is not pollable: %w", err)
	}
	return f, nil
}

func (o *owner) closeFDs() {
	o.fd.Close()
	for _, m := range o.mons {
		m.fd.Close()
	}
}

// start runs the loop on a new goroutine. Handing the sockets to it is
// their one move of ownership; the go statement orders everything the
// constructor did before it.
func (o *owner) start() { go o.run() }

// run runs the loop until stop, an error or a panic, then closes the
// sockets and publishes why it stopped. A panic is logged and becomes
// ErrStopped for everyone waiting: it never reaches the process.
func (o *owner) run() {
	var watchers sync.WaitGroup
	defer close(o.done)
	defer func() {
		o.closeFDs() // ends the watchers
		watchers.Wait()
		o.item.sock.Close()
		for _, m := range o.mons {
			m.sock.Close()
		}
		if o.onExit != nil {
			o.onExit()
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			o.log.Error("control: socket goroutine panicked", "socket", o.name, "panic", r, "stack", string(debug.Stack()))
			o.err = fmt.Errorf("%w: %s: panic: %v", ErrStopped, o.name, r)
		}
	}()
	for _, m := range o.mons {
		watchers.Add(1)
		go func() {
			defer watchers.Done()
			o.watch(m)
		}()
	}
	if err := o.loop(); err != nil {
		o.log.Error("control: socket goroutine stopped", "socket", o.name, "err", err)
		o.err = fmt.Errorf("%w: %s: %w", ErrStopped, o.name, err)
		return
	}
	o.err = ErrClosed
}

// loop is the poll loop. Each round arms the deadline (the tick, or
// whatever a wakeup sets meanwhile), clears poked, and then waits on the
// socket, stepping first and on every signal, until the deadline
// expires. That order loses no wake-up: a wakeup that saw poked set came
// before the clear, so the step after it sees its work; one that set it
// expires the deadline after the arm.
//
// The tick is no part of any work's latency: it is the clock of timed work
// (reconnects on a backoff) and a safety net.
func (o *owner) loop() error {
	wait, err := o.fd.SyscallConn()
	if err != nil {
		return fmt.Errorf("poller: %w", err)
	}
	var stepErr error
	turn := func(uintptr) bool {
		for !o.quitting() {
			if stepErr = o.step(); stepErr != nil {
				return true
			}
			more, err := o.settle()
			if err != nil {
				stepErr = err
				return true
			}
			if !more {
				return false // park until a signal or the deadline
			}
		}
		return true
	}
	for !o.quitting() {
		if err := o.fd.SetReadDeadline(time.Now().Add(tickInterval)); err != nil {
			return fmt.Errorf("poller: %w", err)
		}
		o.poked.Store(false)
		err := wait.Read(turn)
		if stepErr != nil {
			return stepErr
		}
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("poller: %w", err)
		}
	}
	return nil
}

// step reads the monitors that signalled, then serves the socket: what a
// monitor tells (a refusal) applies to the socket's work. Owner only.
func (o *owner) step() error {
	for _, m := range o.mons {
		if m.signalled.Swap(false) && m.read() {
			m.signalled.Store(true) // a batch left: read on next step
		}
	}
	return o.item.serve()
}

// recvEach hands the messages waiting on sock to handle, at most
// recvBatch of them, until EAGAIN or handle returns false. Owner only.
func recvEach(sock *zmq.Socket, handle func(m capped) bool) error {
	for range recvBatch {
		m, err := recvCapped(sock)
		if isAgain(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		if !handle(m) {
			return nil
		}
	}
	return nil
}

// settle reads ZMQ_EVENTS of the socket, which re-arms its ZMQ_FD, and
// reports whether it, or a monitor, has work left. Owner only.
func (o *owner) settle() (bool, error) {
	ev, err := o.item.sock.GetEvents()
	if err != nil {
		return false, fmt.Errorf("events: %w", err)
	}
	more := ev&o.item.wants() != 0
	for _, m := range o.mons {
		more = more || m.signalled.Load()
	}
	return more, nil
}

// watch marks m signalled and wakes the owner on every signal of its
// ZMQ_FD until that is closed. The read never returns between signals,
// so a signal that comes while it wakes the owner is kept by the poller
// for the next wait, never lost.
func (o *owner) watch(m *watched) {
	rc, err := m.fd.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Read(func(uintptr) bool {
		m.signalled.Store(true)
		o.wakeup()
		return false
	})
}

// wakeup makes the owner look for work soon: at once when parked, else
// after the step it is in. Any goroutine; never blocks.
func (o *owner) wakeup() {
	if o.poked.Swap(true) {
		return
	}
	// Fails only once the owner has closed it, when nothing is to be done.
	_ = o.fd.SetReadDeadline(aLongTimeAgo)
}

// quitting reports whether stop was asked. Any goroutine.
func (o *owner) quitting() bool { return isClosed(o.quit) }

// isClosed reports whether ch, a channel only ever closed, is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// stop asks the owner to finish and waits for it. Idempotent, any
// goroutine.
func (o *owner) stop() {
	o.once.Do(func() {
		close(o.quit)
		// Not coalesced: a turn checks quit before it waits.
		_ = o.fd.SetReadDeadline(aLongTimeAgo)
	})
	<-o.done
}

// stopped returns why the owner stopped; valid once done is closed.
func (o *owner) stopped() error {
	<-o.done
	return o.err
}
