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

	mu      sync.Mutex
	refused map[string]uint64
	logged  map[refusal]bool
}

// newGuard configures sock (before bind) for sec and bindHost.
func newGuard(zctx *zmq.Context, sock *zmq.Socket, sec Security, bindHost string, log *slog.Logger) (*guard, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	g := &guard{log: log, policy: newPolicy(sec, bindHost), refused: map[string]uint64{}, logged: map[refusal]bool{}}
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
	if g.mon, err = openMonitor(zctx, sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL); err != nil {
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
		if ev != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL {
			return
		}
		switch {
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

// close leaves the ZAP handler. Call once the socket is closed;
// idempotent.
func (g *guard) close() {
	if g.release != nil {
		g.release()
	}
}

// handshakes follows the security handshakes of a connecting socket (a
// DEALER to one server, a PULL to many publishers) so that a refusal
// becomes a clear error instead of silence until a deadline. libzmq does
// not reconnect after a refused handshake, so the owner reconnects on a
// backoff, which lets a fixed server be reached without restarting.
type handshakes struct {
	log    *slog.Logger
	curve  bool
	mon    *zmq.Socket // owner goroutine only
	states map[string]*handshakeState
	logged map[string]bool // endpoint + cause already logged
}

type handshakeState struct {
	err     error     // the last refusal; nil once a handshake succeeds
	redial  time.Time // when to reconnect after a refusal libzmq will not retry; zero if none
	backoff time.Duration
}

const (
	redialFirst = 500 * time.Millisecond
	redialMax   = 30 * time.Second
)

func newHandshakes(zctx *zmq.Context, sock *zmq.Socket, sec Security, log *slog.Logger) (*handshakes, error) {
	if err := applyClient(sock, sec); err != nil {
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
	return &handshakes{log: log, curve: sec.Curve(), mon: mon, states: map[string]*handshakeState{}, logged: map[string]bool{}}, nil
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
		text, retried := h.explain(ev, value)
		if text == "" {
			return
		}
		st.err = fmt.Errorf("%w: %s: %s", ErrAuth, ep, text)
		if !retried && st.redial.IsZero() {
			st.backoff = min(max(2*st.backoff, redialFirst), redialMax)
			st.redial = now.Add(st.backoff)
		}
		if key := ep + "\x00" + text; !h.logged[key] {
			h.logged[key] = true
			h.log.Error("control: "+text, "peer", ep, "note", "logged once; calls to this peer fail until a handshake succeeds")
		}
		changed(ep, st.err)
	})
}

// explain turns a failure event into what the operator should do, and
// whether libzmq retries on its own. Empty text: not a security failure.
func (h *handshakes) explain(ev zmq.Event, value int) (text string, retried bool) {
	switch ev {
	case zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
		if !h.curve {
			return "", true // a peer that went away mid-handshake
		}
		return "the server closed the connection during the CURVE handshake: it holds a different auth_secret", true
	case zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
		switch {
		case value == protoErrMechanismMismatch && h.curve:
			return "the server has no auth_secret (it speaks plain ZMTP) but this end has one; set the same auth_secret on the consumer", false
		case value == protoErrMechanismMismatch:
			return "the server requires an auth_secret (CURVE); set the deployment's auth_secret (or auth_secret_file; ECMOONCAKE_SECRET for the vLLM connector) here", false
		default:
			return fmt.Sprintf("the security handshake failed (protocol error %#x)", value), false
		}
	case zmq.EVENT_HANDSHAKE_FAILED_AUTH:
		if h.curve {
			return fmt.Sprintf("the server refused this end's CURVE key (ZAP status %d): it holds a different auth_secret", value), false
		}
		return fmt.Sprintf("the server refused this unauthenticated peer (ZAP status %d): a shard bound beyond loopback without auth_secret serves loopback peers only; "+
			"set the same auth_secret on every end, or allow_unauthenticated: true on the consumer", value), false
	}
	return "", true
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
