package control

import (
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// libzmq's handshake failure details (zmq.h, ZMQ_PROTOCOL_ERROR_*), which
// zmq4 does not export.
const (
	protoErrCryptographic     = 0x11000001
	protoErrMechanismMismatch = 0x11000002
)

var monitorSeq atomic.Uint64

// openMonitor asks libzmq to report events of sock on an inproc PAIR and
// returns the reading end, for the owner to poll. Before bind or connect,
// so that no handshake goes unseen.
func openMonitor(zctx *zmq.Context, sock *zmq.Socket, events zmq.Event) (*zmq.Socket, error) {
	addr := fmt.Sprintf("inproc://ecmooncake-monitor-%d", monitorSeq.Add(1))
	if err := sock.Monitor(addr, events); err != nil {
		return nil, fmt.Errorf("control: monitor: %w", err)
	}
	mon, err := zctx.NewSocket(zmq.PAIR)
	if err != nil {
		return nil, fmt.Errorf("control: monitor socket: %w", err)
	}
	if err := mon.SetLinger(0); err != nil {
		mon.Close()
		return nil, fmt.Errorf("control: monitor socket: %w", err)
	}
	if err := mon.Connect(addr); err != nil {
		mon.Close()
		return nil, fmt.Errorf("control: monitor connect %s: %w", addr, err)
	}
	return mon, nil
}

// readEvents hands every queued monitor event to f, until EAGAIN or
// recvBatch of them; full reports the latter. Owner only.
func readEvents(mon *zmq.Socket, f func(ev zmq.Event, addr string, value int)) (full bool) {
	for range recvBatch {
		ev, addr, value, err := mon.RecvEvent(zmq.DONTWAIT)
		if err != nil {
			return false
		}
		f(ev, addr, value)
	}
	return true
}

// guard is the security of one server socket (a shard's ROUTER or event
// PUSH): its policy, registered with the context's ZAP handler, and a
// monitor for the refusals that happen before ZAP is asked (a hello that
// does not decrypt, a peer of the other mechanism). Every refusal is
// counted in ecm_failures_total{component="control"} and in the socket's
// stats, and logged once per cause.
type guard struct {
	log     *slog.Logger
	policy  policy
	mon     *zmq.Socket // owner goroutine only
	release func()      // leaves the ZAP handler; nil without one
	conns   *connCap
	port    int // the bound TCP port; set by bound before the owner starts

	mu      sync.Mutex
	refused map[string]uint64
	logged  map[refusal]bool
}

// newGuard configures sock (before bind) for sec and bindHost.
func newGuard(zctx *zmq.Context, sock *zmq.Socket, sec Security, bindHost string, maxConns, perPeer int, log *slog.Logger) (*guard, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	g := &guard{log: log, policy: newPolicy(sec, bindHost), refused: map[string]uint64{}, logged: map[refusal]bool{},
		conns: newConnCap(maxConns, perPeer)}
	var err error
	if g.policy.zap() {
		var domain string
		if domain, g.release, err = registerZAP(zctx, zapDomain{policy: g.policy, refused: g.refuse}, log); err != nil {
			return nil, err
		}
		if err := applyServer(sock, sec, g.policy, domain); err != nil {
			g.close()
			return nil, err
		}
	}
	// Watched even without ZAP: a plain shard still counts the CURVE peers
	// it cannot talk to, the sign of a secret missing on this side.
	// A hang-up mid-handshake is the other half of the greeting race
	// (see handshakes): the peer found the mechanisms differ first.
	// ACCEPTED and DISCONNECTED keep the connection cap (connCap).
	if g.mon, err = openMonitor(zctx, sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL|zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL|
		zmq.EVENT_ACCEPTED|zmq.EVENT_DISCONNECTED); err != nil {
		g.close()
		return nil, err
	}
	return g, nil
}

// refuse counts and (once per cause) logs one refused peer. Any goroutine.
func (g *guard) refuse(r refusal, peer string) {
	metrics.Failed("control", string(r))
	g.mu.Lock()
	g.refused[string(r)]++
	first := !g.logged[r]
	g.logged[r] = true
	g.mu.Unlock()
	if first {
		g.log.Warn("control: "+g.policy.explain(r, peer), "reason", string(r),
			"note", "later refusals of this cause are only counted (ecm_failures_total{component=\"control\"})")
	}
}

// watch reads the monitor; full as for readEvents. Owner only.
func (g *guard) watch() (full bool) {
	return readEvents(g.mon, func(ev zmq.Event, _ string, value int) {
		switch {
		case ev == zmq.EVENT_ACCEPTED:
			if victim, why := g.conns.accepted(value, peerOf(value)); why != "" {
				if err := shutdownConn(victim, g.port, why); err != nil {
					g.log.Debug("control: connection cap: left a descriptor alone", "err", err)
				}
				g.logCapOnce()
			}
		case ev == zmq.EVENT_DISCONNECTED:
			g.conns.gone(value)
		case ev == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
			g.refuse(refusedAborted, "")
		case ev != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
			// Not a refusal.
		case value == protoErrCryptographic && g.policy.curve:
			g.refuse(refusedWrongSecret, "")
		case value == protoErrMechanismMismatch && g.policy.curve:
			g.refuse(refusedNoSecret, "")
		case value == protoErrMechanismMismatch:
			g.refuse(refusedUnexpectedSecret, "")
		default:
			g.refuse(refusedProtocol, "")
		}
	})
}

// monitor is the guard's monitor, for the owner of the guarded socket to
// read and close.
func (g *guard) monitor() monitor { return monitor{sock: g.mon, read: g.watch} }

// Refused returns the refusals by reason.
func (g *guard) stats() map[string]uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return maps.Clone(g.refused)
}

// bound records the port the socket listens on, for the connection cap.
// Before the owner starts.
func (g *guard) bound(endpoint string) error {
	_, port, err := SplitEndpoint(endpoint)
	if err != nil {
		return err
	}
	g.port = port
	return nil
}

// logCapOnce says, the first time, that the cap closed a connection.
func (g *guard) logCapOnce() {
	g.mu.Lock()
	first := !g.logged[refusedConnCap]
	g.logged[refusedConnCap] = true
	g.mu.Unlock()
	if first {
		g.log.Warn("control: connection cap reached: closing the connections that have waited longest in their handshake",
			"cap", g.conns.table.Max(), "port", g.port, "note", "later closes are only counted (ecm_failures_total{component=\"control\",reason=\"conn_cap\"})")
	}
}

func (g *guard) connStats() (live int, evicted uint64) { return g.conns.stats() }

// close leaves the ZAP handler. Call once the socket is closed;
// idempotent.
func (g *guard) close() {
	if g.release != nil {
		g.release()
	}
}

// Refusals counts the security refusals that clients saw, by reason (the
// labels of ecm_failures_total{component="control_client"}). Any
// goroutine. The ZMQ links of a process object share one among every
// client and subscriber they open, so that the count outlives a client
// the runtime closed after its refusal.
type Refusals struct {
	mu sync.Mutex
	m  map[string]uint64
}

func (r *Refusals) add(reason refusal) {
	r.mu.Lock()
	if r.m == nil {
		r.m = map[string]uint64{}
	}
	r.m[string(reason)]++
	r.mu.Unlock()
}

// Snapshot returns the counts by reason; nil when there were none.
func (r *Refusals) Snapshot() map[string]uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.m) == 0 {
		return nil
	}
	return maps.Clone(r.m)
}

// handshakes follows the security handshakes of a connecting socket (a
// DEALER to one server, a PULL to many publishers) so that a refusal
// becomes a clear error instead of silence until a deadline. libzmq does
// not reconnect after a refused handshake, so the owner reconnects on a
// backoff, which lets a fixed server be reached without restarting.
//
// A server of the other mechanism does not always say so: on a loaded
// host it may read this end's whole greeting at once and hang up before
// writing the rest of its own, and this end sees only a connection closed
// mid-handshake (HANDSHAKE_FAILED_NO_DETAIL). A server that went away
// does that once; one that refuses this end does it on every attempt
// (libzmq reconnects at once after a hang-up). So hangUpsToRefuse
// hang-ups in a row, with no success between, are a refusal.
type handshakes struct {
	log    *slog.Logger
	curve  bool
	mon    *zmq.Socket // owner goroutine only
	states map[string]*handshakeState
	logged map[string]bool // endpoint + cause already logged
	// seen counts every refusal of this socket, shared every refusal of
	// the process object; any goroutine.
	seen, shared *Refusals
}

type handshakeState struct {
	err     error     // the last refusal; nil once a handshake succeeds
	redial  time.Time // when to reconnect after a refusal libzmq will not retry; zero if none
	backoff time.Duration
	hangUps int // hang-ups mid-handshake since the last success
}

const (
	redialFirst = 500 * time.Millisecond
	redialMax   = 30 * time.Second
	// hangUpsToRefuse is how many hang-ups in a row mean a refusal.
	hangUpsToRefuse = 2
)

func newHandshakes(zctx *zmq.Context, sock *zmq.Socket, o clientOptions, log *slog.Logger) (*handshakes, error) {
	if err := applyClient(sock, o.sec); err != nil {
		return nil, err
	}
	mon, err := openMonitor(zctx, sock, zmq.EVENT_HANDSHAKE_SUCCEEDED|zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL|
		zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL|zmq.EVENT_HANDSHAKE_FAILED_AUTH)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &handshakes{log: log, curve: o.sec.Curve(), mon: mon, states: map[string]*handshakeState{}, logged: map[string]bool{},
		seen: &Refusals{}, shared: o.refusals}, nil
}

// watch reads the monitor and calls changed for every endpoint whose
// outcome it learnt: err is the refusal, or nil after a success; full as
// for readEvents. Owner only.
func (h *handshakes) watch(now time.Time, changed func(endpoint string, err error)) (full bool) {
	return readEvents(h.mon, func(ev zmq.Event, ep string, value int) {
		// libzmq may name the peer IPv4-mapped; the sockets here connect
		// to plain IPv4.
		ep = unmapped(ep)
		st := h.states[ep]
		if st == nil {
			st = &handshakeState{}
			h.states[ep] = st
		}
		if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED {
			if st.err != nil {
				h.log.Info("control: security handshake succeeded", "peer", ep)
			}
			*st = handshakeState{}
			changed(ep, nil)
			return
		}
		r, text, retried := h.explain(ev, value)
		if r == admitted {
			return
		}
		h.count(r)
		if r == refusedAborted {
			if st.hangUps++; st.hangUps < hangUpsToRefuse {
				return
			}
		}
		st.err = fmt.Errorf("%w: %s: %s", ErrAuth, ep, text)
		if !retried && st.redial.IsZero() {
			st.backoff = min(max(2*st.backoff, redialFirst), redialMax)
			st.redial = now.Add(st.backoff)
		}
		if key := ep + "\x00" + text; !h.logged[key] {
			h.logged[key] = true
			h.log.Error("control: "+text, "peer", ep, "reason", string(r), "note", "logged once; calls to this peer fail until a handshake succeeds")
		}
		changed(ep, st.err)
	})
}

// count records one refusal seen. Owner only.
func (h *handshakes) count(r refusal) {
	metrics.Failed("control_client", string(r))
	h.seen.add(r)
	if h.shared != nil {
		h.shared.add(r)
	}
}

// explain turns a failure event into the refusal it shows (admitted: not
// a security failure), what the operator should do, and whether libzmq
// retries on its own.
func (h *handshakes) explain(ev zmq.Event, value int) (r refusal, text string, retried bool) {
	switch ev {
	case zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
		if h.curve {
			return refusedAborted, "the server hung up during two CURVE handshakes in a row: it holds a different auth_secret, or none", true
		}
		return refusedAborted, "the server hung up during two security handshakes in a row: it requires an auth_secret (CURVE) and this end has none; " +
			"set the deployment's auth_secret (or auth_secret_file; ECMOONCAKE_SECRET for the vLLM connector) here", true
	case zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
		switch {
		case value == protoErrMechanismMismatch && h.curve:
			return refusedUnexpectedSecret, "the server has no auth_secret (it speaks plain ZMTP) but this end has one; set the same auth_secret on the consumer", false
		case value == protoErrMechanismMismatch:
			return refusedNoSecret, "the server requires an auth_secret (CURVE); set the deployment's auth_secret (or auth_secret_file; ECMOONCAKE_SECRET for the vLLM connector) here", false
		default:
			return refusedProtocol, fmt.Sprintf("the security handshake failed (protocol error %#x)", value), false
		}
	case zmq.EVENT_HANDSHAKE_FAILED_AUTH:
		if h.curve {
			return refusedWrongKey, fmt.Sprintf("the server refused this end's CURVE key (ZAP status %d): it holds a different auth_secret", value), false
		}
		return refusedNotLoopback, fmt.Sprintf("the server refused this unauthenticated peer (ZAP status %d): a shard bound beyond loopback without auth_secret serves loopback peers only; "+
			"set the same auth_secret on every end, or allow_unauthenticated: true on the consumer", value), false
	}
	return admitted, "", true
}

// due returns the endpoints whose reconnect is due and clears their
// timers. Owner only.
func (h *handshakes) due(now time.Time) []string {
	var out []string
	for ep, st := range h.states {
		if !st.redial.IsZero() && !now.Before(st.redial) {
			st.redial = time.Time{}
			out = append(out, ep)
		}
	}
	return out
}

// monitor is the monitor, for the owner of the socket to read and close;
// changed is as for watch.
func (h *handshakes) monitor(changed func(endpoint string, err error)) monitor {
	return monitor{sock: h.mon, read: func() bool { return h.watch(time.Now(), changed) }}
}

// forget drops what is known of an endpoint. Owner only.
func (h *handshakes) forget(ep string) { delete(h.states, ep) }
