package cudaipc

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
)

// How the shard watches the ready words of one attachment: it scans them
// back to back (yielding the thread between scans) for spinFor after the
// last announcement, since a batch's copies end within that (256 MiB take
// ~240 µs on an H100, 1 GiB ~750 µs); then it naps between scans, each
// nap twice the last, from minNap to maxNap, so that an item whose copy
// waits behind a long encoder costs little CPU and is still seen within
// maxNap. A goroutine that yields but never blocks keeps its P from
// polling the network, but not the others: the shard's other sockets are
// served by the rest of GOMAXPROCS meanwhile.
//
// The spin is long because a nap is not short: a Go timer under a
// millisecond sleeps a whole one when nothing else in the process runs
// (the runtime's poller waits in whole milliseconds), which with a 100 µs
// spin put ~1 ms between a word landing and the shard seeing it on an
// H100 host (ready_word_seen 957-1,028 µs after write_ended, p50); and
// nanosleep, the kernel's own nap, took 94-126 µs for 10-40 µs asked on a
// virtual machine whatever the timer slack. Spinning costs one core for
// at most spinFor per batch, only while a copy is pending.
const (
	spinFor = 2 * time.Millisecond
	minNap  = 10 * time.Microsecond
	maxNap  = time.Millisecond
)

// Reasons a shard refuses an announcement or a connection, the keys of
// RecvStats.Rejected and RecvStats.Closed.
const (
	refusedSlotRange   = "slot_range"       // a slot past the region
	refusedSlotBusy    = "slot_busy"        // a slot the shard is watching already
	refusedStaleValue  = "stale_value"      // another attachment's generation, or a sequence not above every earlier one
	refusedBadToken    = "bad_token"        // the token is not the reservation's
	refusedUnknownRes  = "unknown_res"      // no open one-sided write of this shard
	refusedGone        = "gone"             // the write ended meanwhile
	refusedNoRegion    = "no_region"        // an announcement on an attachment without ready words
	refusedBadMessage  = "bad_message"      // bytes that are not an announcement
	refusedComplete    = "complete_refused" // the word came but the sink refused to complete
	wordNeverCame      = "word_never_came"  // the shard gave up on the write before its word
	closedPeerUID      = "peer_uid"         // the peer runs as another user
	closedLimitReached = transport.ClosedLimit
)

// receiver is a shard's exported slab and the abstract socket that hands
// its handle to producers, each with a ready-word region of its own. It
// never sees a byte of a write: producers copy straight into the slab
// (see transport.Direct). It sees their ready words, and completes each
// announced item through the sink when its word appears.
type receiver struct {
	ln     *net.UnixListener
	socket string
	hello  hello // Generation and Slots are set per attachment
	sink   transport.RemoteSink
	log    *slog.Logger
	cfg    Config
	warn   serve.WarnOnce

	gens atomic.Uint32 // the last generation handed out

	requests, attached, badConns, completed atomic.Uint64
	live                                    atomic.Int64  // attachments being served
	accepted                                atomic.Uint64 // announced entries watched
	rejected, closedBy                      serve.Counts

	conns     *serve.Conns[*net.UnixConn]
	closeOnce sync.Once
}

var _ transport.Direct = (*receiver)(nil)

func (t *Transport) listen(sink transport.Sink) (*receiver, error) {
	exp, err := t.cfg.SlabDevice.ExportIPC(t.cfg.Slab.Addr, t.cfg.Slab.Len)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: export the slab on %s: %w", t.cfg.SlabDevice.Name(), err)
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:]) // crypto/rand never fails on Linux
	name := socketPrefix + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(rnd[:])
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("cudaipc: listen on abstract socket @%s: %w", name, err)
	}
	r := &receiver{
		ln: ln, socket: name, cfg: t.cfg,
		hello: hello{Export: exp, Base: uint64(t.cfg.Slab.Addr), Size: t.cfg.Slab.Len, Ordinal: int32(t.cfg.SlabDevice.Ordinal())},
		log:   t.cfg.Logger.With("transport", Name, "socket", "@"+name),
		conns: serve.NewConns[*net.UnixConn](t.cfg.MaxConns),
	}
	if rs, ok := sink.(transport.RemoteSink); ok {
		r.sink = rs
	} else {
		r.log.Info("cudaipc: the shard's sink cannot complete in-band; producers complete by message")
	}
	_, _ = rand.Read(r.hello.Nonce[:])
	r.gens.Store(binary.LittleEndian.Uint32(rnd[:4]))
	r.conns.Go(serve.Acceptor[*net.UnixConn]{
		Accept: r.ln.AcceptUnix,
		Admit: func(c *net.UnixConn) bool {
			return r.conns.Admit(c, r.serve, func(c *net.UnixConn) {
				r.closedBy.Add(closedLimitReached)
				_ = c.Close()
			})
		},
		Failed: func(err error, retryIn time.Duration) {
			r.warn.Log(r.log, "accept", "cudaipc: accept failed", "cause", err, "retry_in", retryIn)
		},
		Done: r.conns.Done(),
		Log:  r.log,
	}.Run)
	return r, nil
}

// Addr is the address the shard publishes: the socket and the nonce of
// this incarnation.
func (r *receiver) Addr() string {
	return peerAddr{socket: r.socket, nonce: r.hello.Nonce}.String()
}

// RemoteAddr is what a write grant carries for the region at slabOff: the
// region's address in the shard's own process. Every one-sided plane of a
// shard names regions this way, so one grant serves whichever a producer
// picks; the writer translates it into its own mapping of the slab.
func (r *receiver) RemoteAddr(slabOff uint64) uint64 { return r.hello.Base + slabOff }

// Stats counts the producers greeted (Attached), the items completed
// in-band by their ready words (Completed), announcements and greetings
// refused (Rejected, by reason) and connections closed (BadConns for
// bytes that are not messages, Closed by reason); Frames and Bytes stay 0,
// since no byte of a write passes through the receiver.
func (r *receiver) Stats() transport.RecvStats {
	return transport.RecvStats{Rejected: r.rejected.Snapshot(), BadConns: r.badConns.Load(), Closed: r.closedBy.Snapshot(),
		Attached: r.attached.Load(), Completed: r.completed.Load()}
}

// Close stops accepting and cuts every connection, which tells each
// producer to close its mapping of the slab and stops every watch.
func (r *receiver) Close() error {
	r.closeOnce.Do(func() {
		r.conns.Close()
		_ = r.ln.Close()
	})
	r.conns.Wait()
	return nil
}

// refuse counts an announcement refused and logs it, rate-limited.
func (r *receiver) refuse(reason string, args ...any) {
	r.rejected.Add(reason)
	r.warn.Log(r.log, reason, "cudaipc: refused a ready-word announcement", args...)
}

// serve greets one producer, then reads its announcements until either
// side goes: the connection's end is how the producer learns that the
// shard is gone (and unmaps the slab), and how the shard learns to stop
// watching the producer's words.
func (r *receiver) serve(c *net.UnixConn) {
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(r.log, p, "cudaipc: panic serving a producer")
		}
	}()
	if err := unixfd.SameUser(c); err != nil {
		r.closedBy.Add(closedPeerUID)
		r.warn.Log(r.log, closedPeerUID, "cudaipc: refused a producer connection", "cause", err)
		return
	}
	_ = c.SetDeadline(time.Now().Add(r.cfg.DialTimeout))
	nonce, err := readHello(c)
	if err != nil {
		if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
			r.badConns.Add(1)
			r.warn.Log(r.log, "bad_hello", "cudaipc: closing connection", "cause", err)
		}
		return
	}
	r.requests.Add(1)
	if subtle.ConstantTimeCompare(nonce[:], r.hello.Nonce[:]) != 1 {
		r.rejected.Add("bad_nonce")
		_, _ = c.Write(appendHelloReply(nil, helloReply{status: statusBadNonce, msg: "this shard does not know that address's nonce (it restarted, or the address is stale)"}))
		return
	}
	a, err := r.greet(c)
	if err != nil {
		r.warn.Log(r.log, "hello_reply", "cudaipc: greeting a producer failed", "cause", err)
		return
	}
	defer a.close()
	_ = c.SetDeadline(time.Time{})
	for {
		as, err := readAnnounce(c)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				r.badConns.Add(1)
				r.refuse(refusedBadMessage, "cause", err)
			}
			return
		}
		a.announce(as)
	}
}

// greet answers a hello with the slab's handle and, when the sink can
// complete in-band, a new ready-word region whose memfd goes with the
// reply; the shard keeps its own mapping of it in the attachment.
func (r *receiver) greet(c *net.UnixConn) (*watcher, error) {
	h := r.hello
	a := &watcher{r: r, wake: make(chan struct{}, 1), done: make(chan struct{}), stopped: make(chan struct{})}
	var rights []byte
	if r.sink != nil {
		fd, w, err := newWordsRegion()
		if err != nil {
			return nil, err
		}
		defer syscall.Close(fd) // the producer's copy and our mapping outlive it
		a.words, a.gen = w, r.gens.Add(1)
		if a.gen == 0 {
			a.gen = r.gens.Add(1)
		}
		h.Generation, h.Slots = a.gen, wordSlots
		rights = syscall.UnixRights(fd)
	}
	// Counted before the reply goes out: a producer that has the handle
	// is one the shard has counted.
	r.attached.Add(1)
	if _, _, err := c.WriteMsgUnix(appendHelloReply(nil, helloReply{hello: h}), rights, nil); err != nil {
		r.attached.Add(^uint64(0))
		if a.words.mem != nil {
			_ = a.words.unmap()
		}
		return nil, err
	}
	r.live.Add(1)
	go a.watch()
	return a, nil
}

// watched is one announced item the shard watches for.
type watched struct {
	res   ids.ResID
	tok   ids.Token
	slot  uint32
	value uint64
	until time.Time // the shard's end of the write; zero: until the connection ends
	// freeOnly: the entry was refused; its word only frees the slot
	freeOnly bool
}

// watcher is the shard's side of one attachment: its ready-word region
// and the items announced on it. The connection's goroutine checks
// announcements (announce); one goroutine of its own scans the words
// (watch).
type watcher struct {
	r       *receiver
	words   words // nil mem: no region (the sink cannot complete in-band)
	gen     uint32
	lastSeq uint32 // the highest sequence accepted; the connection's goroutine only

	mu       sync.Mutex
	busy     [wordSlots]bool // slots watched
	incoming []watched       // accepted, not yet taken by watch

	wake          chan struct{}
	done, stopped chan struct{}
}

// announce checks each entry and hands the ones it accepts to watch.
func (a *watcher) announce(as []announcement) {
	if a.words.mem == nil {
		for range as {
			a.r.refuse(refusedNoRegion)
		}
		return
	}
	for _, e := range as {
		if reason := a.accept(e); reason != "" {
			a.r.refuse(reason, "res", e.Res, "slot", e.Slot)
		}
	}
	select {
	case a.wake <- struct{}{}:
	default:
	}
}

// accept checks one entry against the layout's rules (words.go) and the
// sink, and queues it for watch; it returns the reason of a refusal.
// An entry refused by the sink (its write ended, or was never this
// token's) is still watched, to complete nothing: only to store the 0
// that frees its slot once the producer's word lands there, since a slot
// that keeps its value is one the producer never takes again.
func (a *watcher) accept(e announcement) string {
	if e.Slot >= wordSlots {
		return refusedSlotRange
	}
	gen, seq := splitWord(e.Value)
	if gen != a.gen || seq <= a.lastSeq {
		return refusedStaleValue
	}
	a.lastSeq = seq
	a.mu.Lock()
	busy := a.busy[e.Slot]
	a.mu.Unlock()
	if busy {
		return refusedSlotBusy
	}
	reason := ""
	until, err := a.r.sink.WatchRemote(ids.ResID(e.Res), e.Token)
	switch {
	case errors.Is(err, transport.ErrBadToken):
		reason = refusedBadToken
	case errors.Is(err, transport.ErrUnknownRes):
		reason = refusedUnknownRes
	case err != nil:
		reason = refusedGone
	}
	w := watched{res: ids.ResID(e.Res), tok: e.Token, slot: e.Slot, value: e.Value, until: until, freeOnly: reason != ""}
	if w.freeOnly {
		w.until = time.Time{}
	}
	a.mu.Lock()
	a.busy[e.Slot] = true
	a.incoming = append(a.incoming, w)
	a.mu.Unlock()
	a.r.accepted.Add(1)
	return reason
}

// watch scans the watched words until the connection ends: spinning for
// spinFor after each announcement, then napping longer and longer.
func (a *watcher) watch() {
	defer close(a.stopped)
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(a.r.log, p, "cudaipc: panic watching ready words")
		}
	}()
	var list []watched
	news := time.Now()
	nap := time.Duration(0)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		a.mu.Lock()
		list = append(list, a.incoming...)
		a.incoming = a.incoming[:0]
		a.mu.Unlock()
		if len(list) == 0 {
			select {
			case <-a.wake:
				news, nap = time.Now(), 0
				continue
			case <-a.done:
				return
			}
		}
		list = a.scan(list, time.Now())
		if len(list) == 0 {
			continue
		}
		if time.Since(news) < spinFor {
			runtime.Gosched()
			continue
		}
		nap = min(max(2*nap, minNap), maxNap)
		timer.Reset(nap)
		select {
		case <-a.wake:
			news, nap = time.Now(), 0
		case <-a.done:
			return
		case <-timer.C:
		}
	}
}

// scan completes the items whose word holds their value, drops those the
// shard gave up on, and returns the rest.
func (a *watcher) scan(list []watched, now time.Time) []watched {
	keep := list[:0]
	for _, e := range list {
		switch v := a.words.load(e.slot); {
		case v == e.value:
			// Free the slot before the 0 that tells the producer it may
			// reuse it: an announcement of it may follow that 0 at once.
			a.free(e.slot)
			a.words.store(e.slot, 0)
			if e.freeOnly {
				continue
			}
			if err := a.r.sink.CompleteRemote(e.res, e.tok); err != nil {
				a.r.refuse(refusedComplete, "res", e.res, "cause", err)
				continue
			}
			a.r.completed.Add(1)
		case !e.until.IsZero() && now.After(e.until):
			a.free(e.slot)
			a.r.refuse(wordNeverCame, "res", e.res, "slot", e.slot)
		default:
			keep = append(keep, e)
		}
	}
	return keep
}

func (a *watcher) free(slot uint32) {
	a.mu.Lock()
	a.busy[slot] = false
	a.mu.Unlock()
}

// close stops watch and unmaps the region: the producer is gone, so none
// of its words can complete anything any more. Its items stay being
// written at the shard, which ends them after its writer grace.
func (a *watcher) close() {
	close(a.done)
	<-a.stopped
	if a.words.mem != nil {
		if err := a.words.unmap(); err != nil {
			a.r.log.Warn("cudaipc: unmapping a ready-word region failed", "cause", err)
		}
	}
	a.r.live.Add(-1)
}
