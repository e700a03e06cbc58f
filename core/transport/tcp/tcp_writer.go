package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
	"go.uber.org/atomic"
)

// ackDrain bounds how long a connection whose sending side broke keeps
// reading acks for the frames it had already sent in full.
const ackDrain = 5 * time.Second

// longAgo is a deadline in the past: setting it interrupts a blocked write.
var longAgo = time.Unix(1, 0)

// A sender writes the chunks of one call queued together for its
// connection in one writev, up to these bounds: small items then cost a
// share of one system call each instead of one each. Each chunk stays a
// frame of its own, with its own header, checks and ack.
const (
	maxGroupFrames = 64
	maxGroupBytes  = 1 << 20
)

// tcpWriter owns one pool of connection slots per destination. Each slot
// has a sender goroutine that writes queued chunks in order on the slot's
// current connection, dialing lazily; each connection has an ack-reader
// goroutine that settles chunks by seq.
type tcpWriter struct {
	cfg    TCPConfig
	key    []byte // see proofKey; nil without a secret
	log    *slog.Logger
	dialer net.Dialer
	seq    atomic.Uint64
	// frameWrites counts the writes that carried frames, for tests.
	frameWrites atomic.Uint64
	// afterConn, set only by tests, runs between a sender getting its
	// connection and registering frames on it: the window in which the
	// receiver's answer to the handshake can end the connection.
	afterConn func(*wconn)

	// ctx is cancelled by Close so that dials in progress give up.
	ctx    context.Context
	cancel context.CancelFunc

	closeOnce sync.Once
	shut      atomic.Bool
	wg        sync.WaitGroup

	mu     sync.Mutex
	closed bool
	pools  map[string]*pool
	conns  map[*wconn]struct{}
}

func newTCPWriter(cfg TCPConfig) *tcpWriter {
	ctx, cancel := context.WithCancel(context.Background())
	return &tcpWriter{
		cfg:    cfg,
		key:    proofKey(cfg.Secret),
		log:    cfg.Logger.With("transport", "tcp"),
		dialer: net.Dialer{Timeout: cfg.DialTimeout},
		ctx:    ctx,
		cancel: cancel,
		pools:  make(map[string]*pool),
		conns:  make(map[*wconn]struct{}),
	}
}

type pool struct {
	next  atomic.Uint64
	slots []*slot
}

func (w *tcpWriter) pool(dest string) (*pool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, transport.ErrClosed
	}
	p := w.pools[dest]
	if p == nil {
		p = &pool{slots: make([]*slot, w.cfg.Conns)}
		for i := range p.slots {
			s := &slot{w: w, dest: dest, q: newChunkQueue()}
			p.slots[i] = s
			w.wg.Add(1)
			go s.run()
		}
		w.pools[dest] = p
	}
	return p, nil
}

// Write implements Writer. Chunks are dealt round-robin over the pool,
// continuing where the previous call stopped, so that both one large item
// and many small ones keep every connection busy.
// InBand implements transport.InBandWriter: every frame of an item that
// asks for it carries its completion (FlagComplete).
func (w *tcpWriter) InBand(string) bool { return true }

func (w *tcpWriter) Write(ctx context.Context, dest string, items []transport.WriteItem) []error {
	if errs := transport.RefuseDevice("tcp", dest, items); errs != nil {
		return errs
	}
	c := newCall(ctx, dest, items)
	if len(items) == 0 {
		return c.errs
	}
	if err := ctx.Err(); err != nil {
		return c.failAll(err)
	}
	p, err := w.pool(dest)
	if err != nil {
		return c.failAll(err)
	}
	chunks := c.chunks(w.cfg.ChunkSize)
	n := uint64(len(chunks))
	start := p.next.Add(n) - n
	// Each slot's share goes into its queue at once, so that its sender
	// finds the share queued together and can write it as one group.
	shares := make([][]*chunk, len(p.slots))
	for j := range chunks {
		k := (start + uint64(j)) % uint64(len(p.slots))
		shares[k] = append(shares[k], &chunks[j])
	}
	for k, share := range shares {
		if len(share) > 0 && !p.slots[k].q.push(share...) {
			for _, ch := range share {
				ch.settle(transport.ErrClosed)
			}
		}
	}
	select {
	case <-c.done:
	case <-ctx.Done():
	}
	return c.finish()
}

// Close implements Writer.
func (w *tcpWriter) Close() error {
	w.closeOnce.Do(func() {
		w.mu.Lock()
		w.closed = true
		w.shut.Store(true)
		pools := w.pools
		conns := make([]*wconn, 0, len(w.conns))
		for wc := range w.conns {
			conns = append(conns, wc)
		}
		w.mu.Unlock()
		w.cancel()
		for _, p := range pools {
			for _, s := range p.slots {
				for _, ch := range s.q.close() {
					ch.settle(transport.ErrClosed)
				}
			}
		}
		for _, wc := range conns {
			wc.failAll(transport.ErrClosed)
			_ = wc.c.Close()
		}
	})
	w.wg.Wait()
	return nil
}

// lost names why a chunk on a dead connection failed: the writer's own
// Close, or the connection.
func (w *tcpWriter) lost(cause error) error {
	if w.shut.Load() {
		return transport.ErrClosed
	}
	if errors.Is(cause, io.EOF) {
		cause = errors.New("receiver closed the connection")
	}
	return fmt.Errorf("%w: %w", transport.ErrConnLost, cause)
}

func (w *tcpWriter) track(wc *wconn) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	w.conns[wc] = struct{}{}
	w.wg.Add(1)
	go wc.readAcks()
	return true
}

func (w *tcpWriter) forget(wc *wconn) {
	w.mu.Lock()
	delete(w.conns, wc)
	w.mu.Unlock()
}

// call is the state of one Write: per-item outcomes, and a count of the
// chunks whose Src a sender is reading, so that Write never returns while
// the transport still holds a reference into the caller's memory.
type call struct {
	ctx   context.Context
	dest  string
	items []transport.WriteItem
	done  chan struct{}

	mu        sync.Mutex
	errs      []error
	left      []int
	itemsLeft int
	finished  bool
	writing   int
	idle      chan struct{}
}

func newCall(ctx context.Context, dest string, items []transport.WriteItem) *call {
	return &call{
		ctx:   ctx,
		dest:  dest,
		items: items,
		done:  make(chan struct{}),
		errs:  make([]error, len(items)),
		left:  make([]int, len(items)),
	}
}

func (c *call) failAll(err error) []error {
	for i, it := range c.items {
		c.errs[i] = transport.ItemErr("tcp", c.dest, it.Res, 0, uint64(len(it.Src)), err)
	}
	return c.errs
}

// chunks cuts every item into frames, in one allocation sized up front so
// that no chunk is moved once made.
func (c *call) chunks(size int) []chunk {
	spans := make([][]transport.Span, len(c.items))
	total := 0
	for i, it := range c.items {
		spans[i] = transport.Split(len(it.Src), size)
		c.left[i] = len(spans[i])
		total += len(spans[i])
	}
	out := make([]chunk, total)
	k := 0
	for i := range c.items {
		for _, sp := range spans[i] {
			out[k].call, out[k].item, out[k].off, out[k].end = c, i, sp.Off, sp.End
			k++
		}
	}
	c.itemsLeft = len(c.items)
	return out
}

// begin reports whether a sender may start reading a chunk's Src.
func (c *call) begin() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.finished {
		return false
	}
	c.writing++
	return true
}

func (c *call) end() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writing--
	if c.writing == 0 && c.idle != nil {
		close(c.idle)
		c.idle = nil
	}
}

func (c *call) settle(item int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.finished {
		return
	}
	if err != nil && c.errs[item] == nil {
		c.errs[item] = err
	}
	c.left[item]--
	if c.left[item] == 0 {
		c.itemsLeft--
		if c.itemsLeft == 0 {
			close(c.done)
		}
	}
}

// finish freezes the outcome. Items still open can only be left because
// ctx ended. It then waits for senders still inside this call's Src; a
// cancelled ctx has already interrupted their writes, so the wait is short.
func (c *call) finish() []error {
	c.mu.Lock()
	c.finished = true
	for i, it := range c.items {
		if c.left[i] > 0 && c.errs[i] == nil {
			c.errs[i] = transport.ItemErr("tcp", c.dest, it.Res, 0, uint64(len(it.Src)), c.ctx.Err())
		}
	}
	var idle chan struct{}
	if c.writing > 0 {
		c.idle = make(chan struct{})
		idle = c.idle
	}
	c.mu.Unlock()
	if idle != nil {
		<-idle
	}
	return c.errs
}

// chunk is one frame of one item.
type chunk struct {
	call     *call
	item     int
	off, end int
	seq      uint64
	hdr      [HeaderLen]byte
	settled  atomic.Bool
	// resent: a receiver's goodbye already sent it back to its slot once;
	// a second goodbye fails it, so that a receiver that keeps saying
	// goodbye cannot keep it circling.
	resent atomic.Bool
}

// settle records the chunk's outcome once, whoever gets there first: the
// ack reader, the sender, or Close.
func (ch *chunk) settle(cause error) {
	if !ch.settled.CompareAndSwap(false, true) {
		return
	}
	var err error
	if cause != nil {
		c := ch.call
		err = transport.ItemErr("tcp", c.dest, c.items[ch.item].Res, uint64(ch.off), uint64(ch.end), cause)
	}
	ch.call.settle(ch.item, err)
}

// chunkQueue is an unbounded FIFO so that Write never blocks on a busy
// connection; the ctx of each call bounds how long its chunks wait.
type chunkQueue struct {
	mu     sync.Mutex
	q      []*chunk
	closed bool
	ready  chan struct{}
}

func newChunkQueue() chunkQueue { return chunkQueue{ready: make(chan struct{}, 1)} }

func (q *chunkQueue) push(chs ...*chunk) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return false
	}
	q.q = append(q.q, chs...)
	select {
	case q.ready <- struct{}{}:
	default:
	}
	return true
}

// pop blocks for the next chunk; nil means the queue was closed.
func (q *chunkQueue) pop() *chunk {
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return nil
		}
		if len(q.q) > 0 {
			ch := q.q[0]
			q.q[0] = nil
			q.q = q.q[1:]
			q.mu.Unlock()
			return ch
		}
		q.mu.Unlock()
		<-q.ready
	}
}

// group appends to g the chunks queued right behind g's first that belong
// to the same call, while the group stays within maxGroupFrames and
// maxGroupBytes; it never waits.
func (q *chunkQueue) group(g []*chunk) []*chunk {
	first := g[0]
	bytes := first.end - first.off
	q.mu.Lock()
	defer q.mu.Unlock()
	k := 0
	for k < len(q.q) && len(g) < maxGroupFrames {
		ch := q.q[k]
		if ch.call != first.call || bytes+(ch.end-ch.off) > maxGroupBytes {
			break
		}
		bytes += ch.end - ch.off
		g = append(g, ch)
		q.q[k] = nil
		k++
	}
	q.q = q.q[k:]
	return g
}

func (q *chunkQueue) close() []*chunk {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return nil
	}
	q.closed = true
	rest := q.q
	q.q = nil
	close(q.ready)
	return rest
}

// slot is one connection's worth of a pool. wc, group and bufs belong to
// run's goroutine.
type slot struct {
	w     *tcpWriter
	dest  string
	q     chunkQueue
	wc    *wconn
	group []*chunk
	bufs  net.Buffers
}

func (s *slot) run() {
	defer s.w.wg.Done()
	for ch := s.q.pop(); ch != nil; ch = s.q.pop() {
		s.group = s.q.group(append(s.group[:0], ch))
		s.send(s.group)
		clear(s.group)
	}
}

func settleAll(g []*chunk, err error) {
	for _, ch := range g {
		ch.settle(err)
	}
}

// send writes a group of chunks of one call, each a frame, in one writev.
func (s *slot) send(g []*chunk) {
	c := g[0].call
	if !c.begin() {
		return // Write has returned: its Src may already be gone.
	}
	defer c.end()
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(s.w.log, p, "transport: panic sending frame", "dest", s.dest)
			if s.wc != nil {
				s.retire(s.wc)
			}
			settleAll(g, fmt.Errorf("%w: panic: %v", transport.ErrConnLost, p))
		}
	}()
	wc, err := s.conn(c.ctx)
	if err != nil {
		settleAll(g, err)
		return
	}
	if s.w.afterConn != nil {
		s.w.afterConn(wc)
	}
	s.bufs = s.bufs[:0]
	for _, ch := range g {
		it := c.items[ch.item]
		ch.seq = s.w.seq.Add(1)
		AppendHeader(ch.hdr[:0], Header{
			Seq: ch.seq, Res: it.Res, Token: it.Token,
			Offset: it.Off + uint64(ch.off), Length: uint64(ch.end - ch.off), Complete: it.Complete,
		})
		s.bufs = append(s.bufs, ch.hdr[:], it.Src[ch.off:ch.end])
	}
	// Registered before the first byte goes out: an ack can overtake the
	// return from the write. A connection that died since conn checked it
	// (a goodbye) costs one redial, not the chunks; one refused at its
	// handshake is not redialed, as the next would be refused the same way.
	if !wc.add(g) {
		s.retire(wc)
		if err := wc.refusal(); err != nil {
			settleAll(g, err)
			return
		}
		if wc, err = s.conn(c.ctx); err != nil {
			settleAll(g, err)
			return
		}
		if !wc.add(g) {
			s.retire(wc)
			settleAll(g, s.w.lost(errors.New("connection closed")))
			return
		}
	}
	err = wc.writeFrames(c.ctx, s.bufs)
	clear(s.bufs)
	if err == nil {
		return
	}
	// The stream is out of step after a partial frame: stop sending on it.
	// Frames of the group sent in full before the break may still be
	// acked; the others fail here.
	s.retire(wc)
	// A receiver that refused the connection closes it: the write that
	// broke on that learns why from the refusal, not as a lost connection.
	refused := wc.refusal()
	for _, ch := range g {
		if wc.take(ch.seq) == nil {
			continue
		}
		if ctxErr := ctxEnded(c.ctx, err); ctxErr != nil {
			ch.settle(ctxErr)
			continue
		}
		if refused != nil {
			ch.settle(refused)
			continue
		}
		ch.settle(s.w.lost(err))
	}
}

// ctxEnded reports ctx's error when err came from ctx ending. The write
// deadline copied from ctx can fire a moment before ctx's own timer does, so
// a timeout at or past the deadline counts as the deadline.
func ctxEnded(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	if dl, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

func (s *slot) conn(ctx context.Context) (*wconn, error) {
	if s.wc != nil {
		if s.wc.usable() {
			return s.wc, nil
		}
		s.wc = nil
	}
	w := s.w
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(w.ctx, cancel)
	defer stop()
	c, err := w.dialer.DialContext(dctx, "tcp", s.dest)
	if err != nil {
		if w.shut.Load() {
			return nil, transport.ErrClosed
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, fmt.Errorf("dial: %w", ctxErr)
		}
		return nil, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	tuneConn(c, w.cfg)
	if err := w.handshake(ctx, c); err != nil {
		_ = c.Close()
		return nil, err
	}
	wc := &wconn{w: w, slot: s, c: c, pending: make(map[uint64]*chunk)}
	if !w.track(wc) {
		_ = c.Close()
		return nil, transport.ErrClosed
	}
	s.wc = wc
	return wc, nil
}

// handshake reads a new connection's challenge and answers it, within
// DialTimeout (or ctx's deadline, if sooner). Frames may follow the
// preamble at once: a refusal comes back as an ack.
func (w *tcpWriter) handshake(ctx context.Context, c net.Conn) error {
	deadline := time.Now().Add(w.cfg.DialTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	defer c.SetDeadline(time.Time{})
	b := make([]byte, ChallengeLen, ChallengeLen+PreambleLen)
	if _, err := io.ReadFull(c, b); err != nil {
		if ctxErr := ctxEnded(ctx, err); ctxErr != nil {
			return fmt.Errorf("handshake: %w", ctxErr)
		}
		if timedOut(err) {
			return fmt.Errorf("%w: no challenge from the receiver within %v: it does not speak data protocol v%d (an older build?)", transport.ErrNotAdmitted, w.cfg.DialTimeout, HandshakeVersion)
		}
		return fmt.Errorf("%w: handshake: %w", transport.ErrConnLost, err)
	}
	ch, err := DecodeChallenge(b)
	if err != nil {
		return fmt.Errorf("%w: %w", transport.ErrNotAdmitted, err)
	}
	p := Preamble{Mode: ModeGrant}
	if ch.Mode == ModeSecret {
		if w.key == nil {
			return fmt.Errorf("%w: the receiver admits only writers holding the deployment secret, and this one has no auth_secret", transport.ErrNotAdmitted)
		}
		p = Preamble{Mode: ModeSecret, MAC: prove(w.key, b)}
	}
	if _, err := c.Write(AppendPreamble(b[ChallengeLen:], p)); err != nil {
		return fmt.Errorf("%w: handshake: %w", transport.ErrConnLost, err)
	}
	return nil
}

func (s *slot) retire(wc *wconn) {
	if s.wc == wc {
		s.wc = nil
	}
	wc.stopSending()
}

// wconn is one live connection: the slot's sender writes on it, its ack
// reader reads from it and owns closing it.
type wconn struct {
	w    *tcpWriter
	slot *slot // whose queue a goodbye sends unanswered chunks back to
	c    net.Conn

	mu      sync.Mutex
	dead    bool
	pending map[uint64]*chunk
	// refused is the receiver's refusal of the handshake's proof, once
	// its ack has come back.
	refused error

	// dlMu and gen keep a late ctx interrupt of one frame from hitting the
	// write deadline of the next.
	dlMu sync.Mutex
	gen  uint64
}

func (wc *wconn) usable() bool {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	return !wc.dead
}

// add registers a group's chunks, all or none.
func (wc *wconn) add(g []*chunk) bool {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	if wc.dead {
		return false
	}
	for _, ch := range g {
		wc.pending[ch.seq] = ch
	}
	return true
}

// refusal is the receiver's refusal of this connection, if it sent one.
func (wc *wconn) refusal() error {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	return wc.refused
}

func (wc *wconn) take(seq uint64) *chunk {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	ch := wc.pending[seq]
	delete(wc.pending, seq)
	return ch
}

func (wc *wconn) failAll(err error) {
	for _, ch := range wc.takePending() {
		ch.settle(err)
	}
}

// takePending marks the connection dead, so that no chunk joins the
// pending ones any more, and returns them.
func (wc *wconn) takePending() map[uint64]*chunk {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	wc.dead = true
	pending := wc.pending
	wc.pending = make(map[uint64]*chunk)
	return pending
}

// writeFrames writes headers and payloads in one writev, straight from the
// caller's memory. ctx bounds it through the write deadline, and a cancel
// without a deadline interrupts it the same way.
func (wc *wconn) writeFrames(ctx context.Context, bufs net.Buffers) error {
	deadline, _ := ctx.Deadline()
	wc.dlMu.Lock()
	gen := wc.gen
	err := wc.c.SetWriteDeadline(deadline)
	wc.dlMu.Unlock()
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() {
		wc.dlMu.Lock()
		defer wc.dlMu.Unlock()
		if wc.gen == gen {
			_ = wc.c.SetWriteDeadline(longAgo)
		}
	})
	wc.w.frameWrites.Add(1)
	_, err = bufs.WriteTo(wc.c)
	stop()
	wc.dlMu.Lock()
	wc.gen++
	wc.dlMu.Unlock()
	return err
}

// stopSending half-closes: the receiver sees EOF on the torn frame and
// settles it with EndWrite(false), while acks for the frames sent in full
// before it can still come back.
func (wc *wconn) stopSending() {
	wc.mu.Lock()
	wc.dead = true
	wc.mu.Unlock()
	if tc, ok := wc.c.(*net.TCPConn); ok && tc.CloseWrite() == nil {
		_ = wc.c.SetReadDeadline(time.Now().Add(ackDrain))
		return
	}
	_ = wc.c.Close()
}

func (wc *wconn) readAcks() {
	defer wc.w.wg.Done()
	err := wc.ackLoop()
	if errors.Is(err, errGoodbye) {
		wc.resendPending()
	}
	_ = wc.c.Close()
	if errors.Is(err, transport.ErrNotAdmitted) {
		// Recorded before failAll marks the connection dead, so that a
		// sender that finds it dead also finds why.
		wc.mu.Lock()
		wc.refused = err
		wc.mu.Unlock()
		wc.failAll(err)
	} else {
		wc.failAll(wc.w.lost(err))
	}
	wc.w.forget(wc)
}

// errGoodbye: the receiver closed the connection (idle, or to make room)
// having begun none of the frames it had not acked.
var errGoodbye = errors.New("receiver closed the connection (goodbye)")

// resendPending hands the chunks the receiver never began back to the
// slot, which sends them on a new connection.
func (wc *wconn) resendPending() {
	for _, ch := range wc.takePending() {
		if ch.resent.Swap(true) {
			ch.settle(wc.w.lost(errGoodbye))
			continue
		}
		if !wc.slot.q.push(ch) {
			ch.settle(transport.ErrClosed)
		}
	}
}

func (wc *wconn) ackLoop() (err error) {
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(wc.w.log, p, "transport: panic reading acks")
			err = fmt.Errorf("panic reading acks: %v", p)
		}
	}()
	// Acks of frames that arrived together come back together: one read
	// takes them all.
	br := bufio.NewReaderSize(wc.c, 4<<10)
	var head [AckHeaderLen]byte
	var msg []byte
	for {
		if _, err := io.ReadFull(br, head[:]); err != nil {
			return err
		}
		a, n, err := decodeAckHead(head[:])
		if err != nil {
			return err
		}
		if n > 0 {
			if msg == nil {
				msg = make([]byte, MaxAckMsg)
			}
			if _, err := io.ReadFull(br, msg[:n]); err != nil {
				return err
			}
			a.Msg = string(msg[:n])
		}
		if a.Seq == 0 && a.Status == transport.StatusClosing {
			return errGoodbye
		}
		if a.Seq == 0 && a.Status == transport.StatusNotAdmitted {
			return fmt.Errorf("%w (receiver: %q)", transport.ErrNotAdmitted, a.Msg)
		}
		ch := wc.take(a.Seq)
		if ch == nil {
			return fmt.Errorf("ack for unknown seq %d: %w", a.Seq, transport.ErrBadFrame)
		}
		if e := a.Status.Err(); e != nil {
			ch.settle(fmt.Errorf("%w (receiver: %q)", e, a.Msg))
		} else {
			ch.settle(nil)
		}
	}
}
