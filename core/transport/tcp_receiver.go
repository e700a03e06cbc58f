package transport

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// drainBuf is the scratch size used to discard the payload of a refused
// frame; it is per connection and only allocated on the first refusal.
const drainBuf = 64 << 10

type tcpReceiver struct {
	ln   net.Listener
	sink Sink
	cfg  TCPConfig
	log  *slog.Logger
	logs logLimiter

	stats    recvCounters
	accepted atomic.Uint64

	done      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
}

func newTCPReceiver(ln net.Listener, sink Sink, cfg TCPConfig) *tcpReceiver {
	r := &tcpReceiver{
		ln:    ln,
		sink:  sink,
		cfg:   cfg,
		log:   cfg.Logger.With("transport", "tcp", "listen", ln.Addr().String()),
		done:  make(chan struct{}),
		conns: make(map[net.Conn]struct{}),
	}
	r.wg.Add(1)
	go r.acceptLoop()
	return r
}

func (r *tcpReceiver) Addr() string { return r.ln.Addr().String() }

func (r *tcpReceiver) Stats() RecvStats { return r.stats.snapshot() }

// Close stops accepting, cuts every connection (torn frames end with
// EndWrite(false)) and waits until no goroutine can call the sink again.
func (r *tcpReceiver) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		conns := make([]net.Conn, 0, len(r.conns))
		for c := range r.conns {
			conns = append(conns, c)
		}
		r.mu.Unlock()
		close(r.done)
		_ = r.ln.Close()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	r.wg.Wait()
	return nil
}

func (r *tcpReceiver) acceptLoop() {
	defer r.wg.Done()
	var backoff time.Duration
	for {
		c, err := r.acceptOne()
		if err != nil {
			select {
			case <-r.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Running out of descriptors must not kill the listener: wait
			// and try again, like net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			r.logs.warn(r.log, "transport: accept failed", "err", err, "retry_in", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-r.done:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		backoff = 0
		if c == nil {
			continue
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			_ = c.Close()
			return
		}
		r.conns[c] = struct{}{}
		r.wg.Add(1)
		r.mu.Unlock()
		r.accepted.Add(1)
		go r.serve(c)
	}
}

// acceptOne is split out so that a panic costs one connection, not the
// listener.
func (r *tcpReceiver) acceptOne() (c net.Conn, err error) {
	defer func() {
		if p := recover(); p != nil {
			r.log.Error("transport: panic in accept", "panic", p, "stack", string(debug.Stack()))
			if c != nil {
				_ = c.Close()
			}
			c, err = nil, nil
		}
	}()
	c, err = r.ln.Accept()
	if err != nil {
		return nil, err
	}
	tuneConn(c, r.cfg)
	return c, nil
}

// rconn is one accepted connection; only its serve goroutine touches it.
type rconn struct {
	r       *tcpReceiver
	c       net.Conn
	peer    string
	hdr     [HeaderLen]byte
	ack     []byte
	scratch []byte

	// open is the reservation whose frame end is owed, if any; end ends it.
	open    bool
	openRes ids.ResID
	end     func(ok bool) error
}

func (r *tcpReceiver) serve(c net.Conn) {
	rc := &rconn{r: r, c: c, peer: c.RemoteAddr().String(), ack: make([]byte, 0, AckHeaderLen+MaxAckMsg)}
	defer func() {
		if p := recover(); p != nil {
			r.log.Error("transport: panic serving connection", "peer", rc.peer, "panic", p, "stack", string(debug.Stack()))
		}
		rc.endOpen(false)
		_ = c.Close()
		r.mu.Lock()
		delete(r.conns, c)
		r.mu.Unlock()
		r.wg.Done()
	}()
	for rc.frame() {
	}
}

// endOpen settles the owed EndWrite. It reports false when the sink
// panicked: its state is then unknown, so the frame must not be acked.
// failed is a frame sink's refusal of a frame whose bytes all arrived.
func (rc *rconn) endOpen(ok bool) (settled bool, failed error) {
	if !rc.open {
		return true, nil
	}
	rc.open = false
	defer func() {
		if p := recover(); p != nil {
			rc.r.log.Error("transport: panic in sink EndWrite", "res", rc.openRes, "panic", p, "stack", string(debug.Stack()))
			settled = false
		}
	}()
	return true, rc.end(ok)
}

// frame handles one frame and reports whether the connection is still in
// step and worth reading from.
func (rc *rconn) frame() bool {
	r := rc.r
	if _, err := io.ReadFull(rc.c, rc.hdr[:]); err != nil {
		// EOF between frames is a writer closing its pool; a torn header
		// carried no payload for the sink, so there is nothing to settle.
		return false
	}
	h, err := DecodeHeader(rc.hdr[:])
	if err != nil {
		r.stats.badConns.Add(1)
		r.logs.warn(r.log, "transport: closing connection that sent a bad frame", "peer", rc.peer, "err", err)
		return false
	}
	dst, end, err := openFrame(r.sink, h.Res, h.Token, h.Offset, h.Length)
	if err != nil {
		return rc.refuse(h, err)
	}
	rc.open, rc.openRes, rc.end = true, h.Res, end
	if _, err := io.ReadFull(rc.c, dst); err != nil {
		rc.endOpen(false)
		return false
	}
	settled, failed := rc.endOpen(true)
	if !settled {
		return false
	}
	if failed != nil {
		st := statusOf(failed)
		r.stats.reject(st)
		return rc.sendAck(Ack{Seq: h.Seq, Status: st, Msg: failed.Error()})
	}
	r.stats.landed(h.Length)
	return rc.sendAck(Ack{Seq: h.Seq, Status: StatusOK})
}

// refuse discards the payload so the connection stays in step, then tells
// the writer why.
func (rc *rconn) refuse(h Header, cause error) bool {
	r := rc.r
	st := statusOf(cause)
	r.stats.reject(st)
	r.logs.warn(r.log, "transport: refused frame", "peer", rc.peer, "res", h.Res,
		"offset", h.Offset, "length", h.Length, "reason", st, "err", cause)
	if rc.scratch == nil {
		rc.scratch = make([]byte, drainBuf)
	}
	for left := h.Length; left > 0; {
		n := min(left, uint64(len(rc.scratch)))
		if _, err := io.ReadFull(rc.c, rc.scratch[:n]); err != nil {
			return false
		}
		left -= n
	}
	return rc.sendAck(Ack{Seq: h.Seq, Status: st, Msg: cause.Error()})
}

func (rc *rconn) sendAck(a Ack) bool {
	rc.ack = AppendAck(rc.ack[:0], a)
	if _, err := rc.c.Write(rc.ack); err != nil {
		return false
	}
	return true
}
