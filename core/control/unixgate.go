package control

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// unixGate is the one way into a same-host Unix socket, the call server's
// and the event publisher's alike: it accepts, admits and keeps count of
// every connection, and hands the admitted ones to its owner.
//
// The peer's uid is known at accept (SO_PEERCRED is the connector's,
// fixed at connect), so a connection is judged before it holds a place: a
// uid the rule does not admit is refused there, and so is one of an
// admitted uid over its share of the cap (maxPerUID of maxConns: of the
// uids admitted, this process's and root's, one cannot take every place),
// and one over the cap. A refused connection is counted, then told why
// in place of the hello, then closed: whoever sees a refusal sees it
// counted. The admitted ones pass the secret's handshake by a deadline
// (refused and counted otherwise), then are served on a goroutine each;
// their place is freed when serve returns.
type unixGate struct {
	name  string
	who   string // the peer a refusal is logged of
	ln    *net.UnixListener
	key   []byte
	opt   unixOptions
	log   *slog.Logger
	serve func(c *net.UnixConn, uid uint32) // an admitted connection of uid, still under the handshake's deadline

	mu      sync.Mutex
	conns   map[*net.UnixConn]struct{} // open, in the handshake or admitted
	uids    map[uint32]int             // conns by peer uid
	refused Refusals
	closed  bool
	wg      sync.WaitGroup
}

// withDefaults fills what a caller left zero.
func (o unixOptions) withDefaults() unixOptions {
	d := defaultUnixOptions()
	if o.allowed == nil {
		o.allowed = d.allowed
	}
	if o.uidOf == nil {
		o.uidOf = d.uidOf
	}
	if o.maxConns <= 0 {
		o.maxConns = d.maxConns
	}
	if o.maxPerUID <= 0 {
		o.maxPerUID = d.maxPerUID
	}
	if o.writeTimeout <= 0 {
		o.writeTimeout = d.writeTimeout
	}
	if o.eventQueue <= 0 {
		o.eventQueue = d.eventQueue
	}
	if o.handshakeTimeout <= 0 {
		o.handshakeTimeout = d.handshakeTimeout
	}
	return o
}

// abstractName checks that name is an abstract Unix name (@...), which
// opens no file, for what ("unix listen", ...).
func abstractName(what, name string) error {
	if !strings.HasPrefix(name, "@") {
		return fmt.Errorf("control: %s %q: want an abstract name (@...): %w", what, name, ErrBadEndpoint)
	}
	return nil
}

// listenUnixGate listens on the abstract name and admits peers by opt
// and sec's secret, handing each admitted connection to serve; who names
// the peers in logs.
func listenUnixGate(name, who string, sec Security, log *slog.Logger, opt unixOptions, serve func(c *net.UnixConn, uid uint32)) (*unixGate, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, err
	}
	g := &unixGate{
		name: name, who: who, ln: ln, key: unixKey(sec), opt: opt, log: log, serve: serve,
		conns: map[*net.UnixConn]struct{}{}, uids: map[uint32]int{},
	}
	g.wg.Add(1)
	go g.accept()
	return g, nil
}

// close stops accepting, closes every connection and waits for their
// goroutines. Idempotent.
func (g *unixGate) close() {
	g.mu.Lock()
	if !g.closed {
		g.closed = true
		_ = g.ln.Close()
		for c := range g.conns {
			_ = c.Close()
		}
	}
	g.mu.Unlock()
	g.wg.Wait()
}

// refusals returns the refusals by reason; nil when none.
func (g *unixGate) refusals() map[string]uint64 { return g.refused.Snapshot() }

// open is how many connections hold a place.
func (g *unixGate) open() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.conns)
}

func (g *unixGate) refuse(r refusal, err error) {
	g.refused.add(r)
	metrics.Failed("control", string(r))
	g.log.Warn("control: "+g.who+" refused", "name", g.name, "reason", string(r), "err", err)
}

func (g *unixGate) accept() {
	defer g.wg.Done()
	for {
		c, err := g.ln.AcceptUnix()
		if err != nil {
			g.mu.Lock()
			closed := g.closed
			g.mu.Unlock()
			if closed {
				return
			}
			g.log.Warn("control: unix accept", "name", g.name, "err", err)
			// A full fd table passes; do not spin on it.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		uid, err := g.opt.uidOf(c)
		if err != nil || !g.opt.allowed(uid) {
			g.refuseEarly(c, unixRefusedUID, refusedUnixUID, fmt.Errorf("control: unix peer uid %d (err %v), this process's %d: %w", uid, err, os.Getuid(), ErrAuth))
			continue
		}
		g.mu.Lock()
		switch {
		case g.closed:
			g.mu.Unlock()
			_ = c.Close()
			return
		case g.uids[uid] >= g.opt.maxPerUID:
			g.mu.Unlock()
			g.refuseEarly(c, unixRefusedBusy, refusedUnixUIDCap, fmt.Errorf("uid %d has %d connections open, its share of the cap", uid, g.opt.maxPerUID))
			continue
		case len(g.conns) >= g.opt.maxConns:
			g.mu.Unlock()
			g.refuseEarly(c, unixRefusedBusy, refusedUnixConnCap, fmt.Errorf("%d connections open, the cap", g.opt.maxConns))
			continue
		}
		g.conns[c] = struct{}{}
		g.uids[uid]++
		g.wg.Add(1)
		g.mu.Unlock()
		go g.admit(c, uid)
	}
}

// refuseEarly counts the refusal, then tells c why it is not admitted,
// in place of the hello, and closes it. Not under mu.
func (g *unixGate) refuseEarly(c *net.UnixConn, status byte, r refusal, err error) {
	g.refuse(r, err)
	_ = c.SetWriteDeadline(time.Now().Add(g.opt.writeTimeout))
	_, _ = c.Write(unixEarlyRefusal(status))
	_ = c.Close()
}

// admit runs the handshake of c, a connection holding a place, serves it
// once admitted, and frees its place.
func (g *unixGate) admit(c *net.UnixConn, uid uint32) {
	defer g.wg.Done()
	defer func() {
		if r := recover(); r != nil {
			g.log.Error("control: unix connection failed", "name", g.name, "peer", g.who, "panic", r)
		}
		g.mu.Lock()
		delete(g.conns, c)
		if g.uids[uid]--; g.uids[uid] == 0 {
			delete(g.uids, uid)
		}
		g.mu.Unlock()
		_ = c.Close()
	}()
	_ = c.SetDeadline(time.Now().Add(g.opt.handshakeTimeout))
	if r, err := serverHandshake(c, g.key); err != nil {
		g.refuse(r, err)
		return
	}
	g.serve(c, uid)
}
