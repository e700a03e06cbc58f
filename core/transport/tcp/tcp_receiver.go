package tcp

import (
	"crypto/hmac"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/atomic"
	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// drainBuf is the scratch size used to discard the payload of a refused
// frame; it is per connection and only allocated on the first refusal.
const drainBuf = 64 << 10

// readBuf is each connection's read buffer: headers and small frames that
// arrive together are parsed from it without a read each, while the part
// of a payload beyond what is buffered is read straight into the slab.
// Small, because what it holds of a large payload is copied twice.
const readBuf = 8 << 10

// maxOwedAcks bounds the acks a connection holds back before it writes
// them (see ackingReader).
const maxOwedAcks = 16 << 10

// maxHeldFrames bounds the frames whose acks, and whose items' readiness
// (transport.FlushSink), a connection holds back while more of its stream
// is already here: at 64 KiB a frame, the first item of a long stream is
// announced after 4 MiB more have landed, not after the whole stream.
const maxHeldFrames = 64

type tcpReceiver struct {
	ln   net.Listener
	sink transport.Sink
	cfg  TCPConfig
	log  *slog.Logger
	logs logLimiter

	stats     transport.RecvCounters
	accepted  atomic.Uint64
	ackWrites atomic.Uint64 // writes that carried acks, for tests
	reads     atomic.Uint64 // read system calls on data connections, for tests

	done      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup

	// onceLogged keeps the cap's warnings to one each: the counters say
	// how often it bit.
	limitLogged, evictLogged atomic.Bool

	// key is the data plane's key derived from the secret; nil means
	// connections prove themselves with a live grant (ModeGrant).
	key  []byte
	mode Mode

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]*rconn
	// proven and unproven count the connections holding a slot of each
	// budget (MaxConns, MaxUnproven); one told to go holds none.
	proven, unproven int
}

func newTCPReceiver(ln net.Listener, sink transport.Sink, cfg TCPConfig) *tcpReceiver {
	r := &tcpReceiver{
		ln:    ln,
		sink:  sink,
		cfg:   cfg,
		log:   cfg.Logger.With("transport", "tcp", "listen", ln.Addr().String()),
		done:  make(chan struct{}),
		conns: make(map[net.Conn]*rconn),
		key:   proofKey(cfg.Secret),
		mode:  modeOf(cfg.Secret),
	}
	r.wg.Add(1)
	go r.acceptLoop()
	return r
}

func (r *tcpReceiver) Addr() string { return r.ln.Addr().String() }

func (r *tcpReceiver) Stats() transport.RecvStats { return r.stats.Snapshot() }

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
	serve.Acceptor[net.Conn]{
		Accept: r.ln.Accept,
		Tune:   func(c net.Conn) { tuneConn(c, r.cfg) },
		Admit:  r.admit,
		Failed: func(err error, retryIn time.Duration) {
			r.logs.warn(r.log, "transport: accept failed", "err", err, "retry_in", retryIn)
		},
		Done: r.done,
		Log:  r.log,
	}.Run()
}

// modeOf is the proof a receiver with secret asks for.
func modeOf(secret Secret) Mode {
	if secret != "" {
		return ModeSecret
	}
	return ModeGrant
}

// admit serves c unless the receiver is closing. A new connection holds
// a slot of the unproven budget until it proves itself (see handshake); at
// MaxUnproven it takes the place of the oldest unproven one, so that
// connections that stall in their handshake can neither lock out a
// newcomer for long nor touch a proven connection's slot. Its own
// bookkeeping is why it does not use Conns.
func (r *tcpReceiver) admit(c net.Conn) bool {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		_ = c.Close()
		return false
	}
	if r.unproven >= r.cfg.MaxUnproven {
		r.evictUnprovenLocked()
	}
	now := time.Now()
	rc := &rconn{r: r, c: c, peer: c.RemoteAddr().String(), acks: make([]byte, 0, AckHeaderLen+MaxAckMsg), idleSince: now, since: now}
	rc.br = newFrameReader(rc, c)
	r.unproven++
	r.conns[c] = rc
	r.wg.Add(1)
	r.mu.Unlock()
	r.accepted.Add(1)
	go r.serve(rc)
	return true
}

// evictLocked makes room for a new connection by telling the one idle
// longest to go; it reports false when every connection has a frame in
// flight. Idle connections cost a writer nothing to lose (a goodbye makes
// it resend on a new one), while refusing the newcomer could lock a
// producer out for as long as idle peers hold every slot.
func (r *tcpReceiver) evictLocked() bool {
	var oldest *rconn
	for _, rc := range r.conns {
		if rc.proven && !rc.idleSince.IsZero() && !rc.evicted && (oldest == nil || rc.idleSince.Before(oldest.idleSince)) {
			oldest = rc
		}
	}
	if oldest == nil {
		return false
	}
	oldest.evicted = true
	r.proven--
	// Wakes its serve goroutine, which owns the connection's writes and
	// sends the goodbye itself.
	_ = oldest.c.SetReadDeadline(longAgo)
	if !r.evictLogged.Swap(true) {
		r.log.Warn("transport: at max_data_conns, closing idle connections to admit new ones (logged once; see ecm_data_conns_closed_total)",
			"max_conns", r.cfg.MaxConns, "peer", oldest.peer)
	}
	return true
}

// evictUnprovenLocked tells the oldest connection still in its handshake
// to go: the newest are the ones most likely to prove themselves next.
func (r *tcpReceiver) evictUnprovenLocked() {
	var oldest *rconn
	for _, rc := range r.conns {
		if !rc.proven && !rc.evicted && (oldest == nil || rc.since.Before(oldest.since)) {
			oldest = rc
		}
	}
	if oldest == nil {
		return
	}
	oldest.evicted = true
	r.unproven--
	_ = oldest.c.SetReadDeadline(longAgo)
}

// promote moves a connection that proved itself to the proven budget,
// making room by evicting an idle proven one at MaxConns; it reports
// false when every proven connection has a frame in flight.
func (rc *rconn) promote() bool {
	r := rc.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if rc.evicted {
		return false
	}
	if r.proven >= r.cfg.MaxConns && !r.evictLocked() {
		r.stats.Close(transport.ClosedLimit)
		if !r.limitLogged.Swap(true) {
			r.log.Warn("transport: at max_data_conns with a frame in flight on each; refusing new connections (logged once; see ecm_data_conns_closed_total)",
				"max_conns", r.cfg.MaxConns, "peer", rc.peer)
		}
		return false
	}
	rc.proven = true
	r.unproven--
	r.proven++
	return true
}

// rconn is one accepted connection; only its serve goroutine reads or
// writes it.
type rconn struct {
	r       *tcpReceiver
	c       net.Conn
	br      *frameReader
	peer    string
	hdr     [HeaderLen]byte
	scratch []byte
	// acks owed to the writer, held back while more of the stream is
	// already here, so that frames that arrive together are answered by
	// one write; they go out before any read that would wait
	// (frameReader.read).
	acks []byte
	owed int // frames acks holds

	// open is the reservation whose frame end is owed, if any; end ends it.
	open    bool
	openRes ids.ResID
	end     func(ok bool) error

	// Guarded by r.mu. idleSince is when the connection last had no
	// frame in flight (zero while one is); evicted says the accept loop
	// told it to go; proven that it passed its handshake; since is when
	// it was accepted.
	idleSince time.Time
	since     time.Time
	evicted   bool
	proven    bool
}

func (r *tcpReceiver) serve(rc *rconn) {
	c := rc.c
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(r.log, p, "transport: panic serving connection", "peer", rc.peer)
		}
		rc.endOpen(false)
		// Frames that landed before whatever ends the connection are
		// still answered.
		rc.flush()
		_ = c.Close()
		r.mu.Lock()
		delete(r.conns, c)
		switch {
		case rc.evicted:
		case rc.proven:
			r.proven--
		default:
			r.unproven--
		}
		r.mu.Unlock()
		r.wg.Done()
	}()
	if !rc.handshake() {
		return
	}
	for rc.frame() {
	}
}

// handshake sends the connection its challenge and reads its proof, all
// within HandshakeTimeout. In ModeSecret the preamble's MAC is the proof;
// in ModeGrant it is the first frame, which handshake then serves. It
// reports whether the connection is proven and in step.
func (rc *rconn) handshake() bool {
	r := rc.r
	_ = rc.c.SetDeadline(time.Now().Add(r.cfg.HandshakeTimeout))
	ch := Challenge{Mode: r.mode}
	if _, err := rand.Read(ch.Nonce[:]); err != nil {
		r.logs.warn(r.log, "transport: no randomness for a challenge", "err", err)
		return false
	}
	challenge := AppendChallenge(make([]byte, 0, ChallengeLen), ch)
	if _, err := rc.c.Write(challenge); err != nil {
		return false
	}
	var pre [PreambleLen]byte
	if _, err := io.ReadFull(rc.br, pre[:]); err != nil {
		rc.unproven(err)
		return false
	}
	p, err := DecodePreamble(pre[:])
	switch {
	case err != nil:
		rc.notAdmitted(err.Error())
		return false
	case r.mode == ModeSecret && p.Mode != ModeSecret:
		rc.notAdmitted("this receiver admits only connections proven with the deployment secret (auth_secret); the writer has none")
		return false
	case r.mode == ModeSecret && !hmac.Equal(p.MAC[:], proveSlice(r.key, challenge)):
		rc.notAdmitted("the preamble's proof does not match this connection's challenge: a different auth_secret, or a replay")
		return false
	case r.mode == ModeGrant && p.Mode != ModeGrant:
		rc.notAdmitted("this receiver has no auth_secret: the writer has one, the receiver none; set the same auth_secret on both")
		return false
	case r.mode == ModeSecret:
		if !rc.promote() {
			rc.notAdmitted(fmt.Sprintf("at max_data_conns (%d) with a frame in flight on each", r.cfg.MaxConns))
			return false
		}
		return true
	}
	// ModeGrant: the first frame, whose header must arrive within the
	// handshake deadline too, proves the connection once the sink takes it.
	if _, err := io.ReadFull(rc.br, rc.hdr[:]); err != nil {
		rc.unproven(err)
		return false
	}
	h, err := DecodeHeader(rc.hdr[:])
	if err != nil {
		rc.notAdmitted(err.Error())
		return false
	}
	dst, end, err := transport.OpenFrame(r.sink, h.Res, h.Token, h.Offset, h.Length, h.Complete)
	if err != nil {
		st := transport.StatusOf(err)
		r.stats.Reject(st)
		rc.sendAck(Ack{Seq: h.Seq, Status: st, Msg: err.Error()})
		// The frames behind it were not begun: a goodbye lets the writer
		// send them again on a connection that a live grant proves.
		r.stats.Close(transport.ClosedNotAdmitted)
		_ = rc.c.SetDeadline(time.Now().Add(goodbyeWait))
		rc.sendAck(Ack{Seq: 0, Status: transport.StatusClosing, Msg: transport.ClosedNotAdmitted + ": the first frame names no live grant"})
		rc.linger()
		return false
	}
	rc.open, rc.openRes, rc.end = true, h.Res, end
	if !rc.promote() {
		rc.endOpen(false)
		rc.notAdmitted(fmt.Sprintf("at max_data_conns (%d) with a frame in flight on each", r.cfg.MaxConns))
		return false
	}
	if !rc.busy() {
		rc.endOpen(false)
		return false
	}
	defer rc.idle()
	_ = rc.c.SetDeadline(time.Now().Add(r.cfg.FrameTimeout))
	return rc.payload(h, dst)
}

func proveSlice(key, challenge []byte) []byte {
	m := prove(key, challenge)
	return m[:]
}

// unproven ends a connection whose proof did not arrive: it stalled, it
// was evicted to make room, or the peer left.
func (rc *rconn) unproven(err error) {
	switch {
	case rc.isEvicted():
		rc.r.stats.Close(transport.ClosedUnprovenEvicted)
		// Best effort, and no lingering: a slot given up must not hold
		// a goroutine. A writer that did prove in the meantime resends.
		_ = rc.c.SetWriteDeadline(time.Now().Add(goodbyeWait))
		rc.sendAck(Ack{Seq: 0, Status: transport.StatusClosing, Msg: transport.ClosedUnprovenEvicted})
		rc.flush()
	case timedOut(err):
		rc.r.stats.Close(transport.ClosedHandshakeTimeout)
	}
}

// notAdmitted refuses a connection, telling the writer why; the frames it
// sent after its preamble are read and dropped, so that the refusal
// reaches it before the close.
func (rc *rconn) notAdmitted(why string) {
	r := rc.r
	r.stats.Close(transport.ClosedNotAdmitted)
	r.logs.warn(r.log, "transport: refusing a data connection that did not prove itself", "peer", rc.peer, "reason", why)
	_ = rc.c.SetDeadline(time.Now().Add(goodbyeWait))
	rc.sendAck(Ack{Seq: 0, Status: transport.StatusNotAdmitted, Msg: why})
	rc.linger()
}

// busy marks a frame in flight; it reports false when the connection was
// evicted first, and then no frame may begin on it.
func (rc *rconn) busy() bool {
	rc.r.mu.Lock()
	defer rc.r.mu.Unlock()
	if rc.evicted {
		return false
	}
	rc.idleSince = time.Time{}
	return true
}

func (rc *rconn) idle() {
	rc.r.mu.Lock()
	rc.idleSince = time.Now()
	rc.r.mu.Unlock()
}

func (rc *rconn) isEvicted() bool {
	rc.r.mu.Lock()
	defer rc.r.mu.Unlock()
	return rc.evicted
}

// goodbyeWait bounds how long a closing connection waits for the writer
// to take its goodbye and close its side.
const goodbyeWait = time.Second

// goodbye closes a connection that has no frame begun since its last ack,
// telling the writer so (an ack with Seq 0 and StatusClosing): it may
// resend on a new connection whatever it sent after that ack. The rest of
// what the writer sent is read and dropped, so that closing does not reset
// the connection before the goodbye reaches the writer.
func (rc *rconn) goodbye(reason string) {
	rc.r.stats.Close(reason)
	_ = rc.c.SetDeadline(time.Now().Add(goodbyeWait))
	if !rc.sendAck(Ack{Seq: 0, Status: transport.StatusClosing, Msg: reason}) {
		return
	}
	rc.linger()
}

// linger sends the acks owed, closes the sending side and reads what the
// writer still sends until it closes too (within the deadline set): a
// close with unread bytes would reset the connection, and a reset can
// discard acks already on their way to the writer.
func (rc *rconn) linger() {
	if !rc.flush() {
		return
	}
	if tc, ok := rc.c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, rc.c)
}

// timedOut reports whether err is a deadline passing.
func timedOut(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// stalled ends a frame that did not finish within FrameTimeout.
func (rc *rconn) stalled(h *Header, got int, err error) {
	r := rc.r
	r.stats.Close(transport.ClosedFrameTimeout)
	args := []any{"peer", rc.peer, "frame_timeout", r.cfg.FrameTimeout, "err", err}
	if h != nil {
		args = append(args, "res", h.Res, "offset", h.Offset, "length", h.Length, "received", got)
	}
	r.logs.warn(r.log, "transport: closing a connection whose frame stalled; the frame ends torn", args...)
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
			serve.LogPanic(rc.r.log, p, "transport: panic in sink EndWrite", "res", rc.openRes)
			settled = false
		}
	}()
	return true, rc.end(ok)
}

// frame handles one frame and reports whether the connection is still in
// step and worth reading from. Between frames the connection may idle for
// IdleTimeout; from a frame's first byte to its ack, FrameTimeout bounds
// both directions, so that a writer that stalls (or a peer that sends
// half a frame and waits) frees its region's writes in time.
func (rc *rconn) frame() bool {
	r := rc.r
	_ = rc.c.SetDeadline(time.Now().Add(r.cfg.IdleTimeout))
	// An eviction between the last frame and the deadline just set would
	// have had its wake-up overwritten.
	if rc.isEvicted() {
		rc.goodbye(transport.ClosedEvicted)
		return false
	}
	if _, err := io.ReadFull(rc.br, rc.hdr[:1]); err != nil {
		// EOF between frames is a writer closing its pool.
		switch {
		case rc.isEvicted():
			rc.goodbye(transport.ClosedEvicted)
		case timedOut(err):
			rc.goodbye(transport.ClosedIdle)
		}
		return false
	}
	if !rc.busy() {
		// Evicted as the frame began: nothing of it reached the sink, so
		// the writer may resend it elsewhere.
		rc.goodbye(transport.ClosedEvicted)
		return false
	}
	defer rc.idle()
	_ = rc.c.SetDeadline(time.Now().Add(r.cfg.FrameTimeout))
	if n, err := io.ReadFull(rc.br, rc.hdr[1:]); err != nil {
		// A torn header carried no payload for the sink, so there is
		// nothing to settle.
		if timedOut(err) {
			rc.stalled(nil, 1+n, err)
		}
		return false
	}
	h, err := DecodeHeader(rc.hdr[:])
	if err != nil {
		r.stats.BadConn()
		r.logs.warn(r.log, "transport: closing connection that sent a bad frame", "peer", rc.peer, "err", err)
		// The frames before it are answered, and must reach the writer.
		_ = rc.c.SetDeadline(time.Now().Add(goodbyeWait))
		rc.linger()
		return false
	}
	dst, end, err := transport.OpenFrame(r.sink, h.Res, h.Token, h.Offset, h.Length, h.Complete)
	if err != nil {
		return rc.refuse(h, err)
	}
	rc.open, rc.openRes, rc.end = true, h.Res, end
	return rc.payload(h, dst)
}

// payload reads an open frame's payload into dst and acks it.
func (rc *rconn) payload(h Header, dst []byte) bool {
	r := rc.r
	if n, err := io.ReadFull(rc.br, dst); err != nil {
		rc.endOpen(false)
		if timedOut(err) {
			rc.stalled(&h, n, err)
		}
		return false
	}
	settled, failed := rc.endOpen(true)
	if !settled {
		return false
	}
	if failed != nil {
		st := transport.StatusOf(failed)
		r.stats.Reject(st)
		return rc.sendAck(Ack{Seq: h.Seq, Status: st, Msg: failed.Error()})
	}
	r.stats.Landed(h.Length)
	return rc.sendAck(Ack{Seq: h.Seq, Status: transport.StatusOK})
}

// refuse discards the payload so the connection stays in step, then tells
// the writer why.
func (rc *rconn) refuse(h Header, cause error) bool {
	r := rc.r
	st := transport.StatusOf(cause)
	r.stats.Reject(st)
	r.logs.warn(r.log, "transport: refused frame", "peer", rc.peer, "res", h.Res,
		"offset", h.Offset, "length", h.Length, "reason", st, "err", cause)
	if rc.scratch == nil {
		rc.scratch = make([]byte, drainBuf)
	}
	for left := h.Length; left > 0; {
		n := min(left, uint64(len(rc.scratch)))
		if _, err := io.ReadFull(rc.br, rc.scratch[:n]); err != nil {
			if timedOut(err) {
				rc.stalled(&h, int(h.Length-left), err)
			}
			return false
		}
		left -= n
	}
	return rc.sendAck(Ack{Seq: h.Seq, Status: st, Msg: cause.Error()})
}

// sendAck owes the writer an ack; it is written with the others owed
// before the next read that would wait, or once they fill maxOwedAcks or
// answer maxHeldFrames frames.
func (rc *rconn) sendAck(a Ack) bool {
	rc.acks = AppendAck(rc.acks, a)
	rc.owed++
	if len(rc.acks) >= maxOwedAcks || rc.owed >= maxHeldFrames {
		return rc.flush()
	}
	return true
}

// frameReader is a connection's buffered reader. It writes the acks owed
// before a read that would wait for the network, and only then, so that a
// writer waiting for them is never stuck, while a stream of frames already
// in the socket (a writer's group, a large item's chunks) is answered by
// one write however large its payloads are. A read at least as large as
// its buffer (a payload going straight into the slab) is one readv into
// the caller's bytes and the buffer, so that the next frame's header comes
// with the payload before it: one system call a frame. Where the
// connection gives no raw access, it reads plainly and writes the acks
// owed before every read.
type frameReader struct {
	rc   *rconn
	raw  syscall.RawConn
	buf  []byte
	r, w int // buf[r:w] is read and not yet taken

	// The raw read's arguments and results, kept here with the callback
	// made once, so that a read allocates nothing: a closure over locals
	// and readv's iovecs would each cost an allocation a frame.
	tryRead func(fd uintptr) bool
	iov     [2]unix.Iovec
	a, b    []byte
	wait    bool
	n       int
	rerr    error
}

func newFrameReader(rc *rconn, c net.Conn) *frameReader {
	fr := &frameReader{rc: rc, buf: make([]byte, readBuf)}
	if sc, ok := c.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			fr.raw = raw
			fr.tryRead = fr.readOnce
		}
	}
	return fr
}

// Read implements io.Reader: what the buffer holds first; else a read
// into the buffer for a small p, or into p and the buffer for a large one.
func (fr *frameReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if fr.r < fr.w {
		n := copy(p, fr.buf[fr.r:fr.w])
		fr.r += n
		return n, nil
	}
	fr.r, fr.w = 0, 0
	if len(p) < len(fr.buf) {
		n, err := fr.read(fr.buf, nil)
		if n == 0 {
			return 0, err
		}
		fr.w = n
		n = copy(p, fr.buf[:n])
		fr.r = n
		return n, nil
	}
	n, err := fr.read(p, fr.buf)
	if n > len(p) {
		fr.w = n - len(p)
		return len(p), nil
	}
	return n, err
}

// read is one read system call into a, then b (nil: a alone), that writes
// the acks owed first when it would wait; at least one byte, or an error.
func (fr *frameReader) read(a, b []byte) (int, error) {
	rc := fr.rc
	if fr.raw == nil {
		if len(rc.acks) > 0 && !rc.flush() {
			return 0, errAckWrite
		}
		rc.r.reads.Add(1)
		return rc.c.Read(a)
	}
	fr.a, fr.b = a, b
	defer func() { fr.a, fr.b = nil, nil }()
	for {
		// With acks owed, a read that would wait returns instead: they
		// are written, and the read is tried again, waiting this time.
		fr.wait = len(rc.acks) == 0
		cerr := fr.raw.Read(fr.tryRead)
		n, rerr := fr.n, fr.rerr
		switch {
		case cerr != nil:
			return 0, cerr
		case rerr == syscall.EAGAIN:
			if !rc.flush() {
				return 0, errAckWrite
			}
			continue
		case rerr != nil:
			return 0, os.NewSyscallError("readv", rerr)
		case n == 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

// readOnce is the raw read's callback: one read system call into fr.a,
// then fr.b when it is not nil, retried on EINTR; it reports whether the
// read is over (it waits in the poller on EAGAIN unless fr.wait is off).
func (fr *frameReader) readOnce(fd uintptr) bool {
	for {
		fr.rc.r.reads.Add(1)
		fr.n, fr.rerr = fr.readv(int(fd))
		if fr.rerr != syscall.EINTR {
			break
		}
	}
	return fr.rerr != syscall.EAGAIN || !fr.wait
}

// readv reads into fr.a, then fr.b when it is not nil, through the
// reader's own iovecs.
func (fr *frameReader) readv(fd int) (int, error) {
	if fr.b == nil {
		return syscall.Read(fd, fr.a)
	}
	fr.iov[0].Base, fr.iov[1].Base = unsafe.SliceData(fr.a), unsafe.SliceData(fr.b)
	fr.iov[0].SetLen(len(fr.a))
	fr.iov[1].SetLen(len(fr.b))
	n, _, errno := unix.Syscall(unix.SYS_READV, uintptr(fd), uintptr(unsafe.Pointer(&fr.iov[0])), 2)
	fr.iov[0].Base, fr.iov[1].Base = nil, nil
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// errAckWrite ends a read whose owed acks could not be written: the
// connection is of no more use.
var errAckWrite = errors.New("transport: writing acks failed")

// flush publishes what the frames it answers completed (their items'
// readiness, transport.FlushSink), then writes their acks.
func (rc *rconn) flush() bool {
	if len(rc.acks) == 0 {
		return true
	}
	rc.publish()
	rc.r.ackWrites.Add(1)
	_, err := rc.c.Write(rc.acks)
	rc.acks, rc.owed = rc.acks[:0], 0
	return err == nil
}

// publish is the sink's Flush; a panic in it is logged, and the acks
// still go out (what the sink published or not is its own state).
func (rc *rconn) publish() {
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(rc.r.log, p, "transport: panic in sink Flush", "peer", rc.peer)
		}
	}()
	transport.Flush(rc.r.sink)
}
