package control

import (
	"fmt"
	"log/slog"
	"sync"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/atomic"
)

// zapEndpoint is where libzmq asks, within one context, whether to admit
// a new connection (ZMQ RFC 27).
const zapEndpoint = "inproc://zeromq.zap.01"

// zapHandler answers ZAP requests for every server socket of one zmq
// context. libzmq looks the handler up per context, and each process
// object here owns its own context, so the handler is per context too
// (zmq4's AuthStart serves only the default context, from global state).
// Server sockets register a domain with their policy; the first
// registration starts the handler and the last release stops it, so its
// socket is closed before the context is terminated.
type zapHandler struct {
	*owner
	zctx *zmq.Context
	sock *zmq.Socket // REP; owner goroutine only

	mu      sync.Mutex
	domains map[string]zapDomain
}

type zapDomain struct {
	policy  policy
	refused func(r refusal, peer string)
}

var (
	zapMu       sync.Mutex
	zapHandlers = map[*zmq.Context]*zapHandler{}
	zapSeq      atomic.Uint64
)

// registerZAP adds domain to the handler of zctx, starting it if needed.
// The returned function removes it again; call it once the socket is
// closed.
func registerZAP(zctx *zmq.Context, d zapDomain, log *slog.Logger) (domain string, release func(), err error) {
	zapMu.Lock()
	defer zapMu.Unlock()
	z := zapHandlers[zctx]
	if z == nil {
		if z, err = startZAP(zctx, log); err != nil {
			return "", nil, err
		}
		zapHandlers[zctx] = z
	}
	domain = fmt.Sprintf("ecmooncake-%d", zapSeq.Add(1))
	z.mu.Lock()
	z.domains[domain] = d
	z.mu.Unlock()
	var once sync.Once
	release = func() {
		once.Do(func() {
			zapMu.Lock()
			defer zapMu.Unlock()
			z.mu.Lock()
			delete(z.domains, domain)
			empty := len(z.domains) == 0
			z.mu.Unlock()
			if empty {
				delete(zapHandlers, zctx)
				z.stop()
			}
		})
	}
	return domain, release, nil
}

func startZAP(zctx *zmq.Context, log *slog.Logger) (*zapHandler, error) {
	sock, err := newSocket(zctx, zmq.REP)
	if err != nil {
		return nil, err
	}
	if err := sock.Bind(zapEndpoint); err != nil {
		sock.Close()
		return nil, fmt.Errorf("control: bind ZAP handler %s: %w", zapEndpoint, err)
	}
	z := &zapHandler{zctx: zctx, sock: sock, domains: map[string]zapDomain{}}
	if z.owner, err = newOwner(log, "zap handler", pollItem{sock: sock, serve: z.answerBatch}); err != nil {
		sock.Close()
		return nil, err
	}
	z.start()
	return z, nil
}

func (z *zapHandler) answerBatch() error {
	for range recvBatch {
		req, err := z.sock.RecvMessageBytes(zmq.DONTWAIT)
		if isAgain(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("receive ZAP request: %w", err)
		}
		// REP must answer every request, even one it cannot read.
		if _, err := z.sock.SendMessageDontwait(z.answer(req)...); err != nil {
			return fmt.Errorf("send ZAP reply: %w", err)
		}
	}
	return nil
}

// answer turns one ZAP request (version, request id, domain, address,
// identity, mechanism, credentials...) into its reply frames.
func (z *zapHandler) answer(req [][]byte) []any {
	reply := func(id []byte, code, text string) []any {
		return []any{"1.0", id, code, text, "", ""}
	}
	if len(req) < 6 || string(req[0]) != "1.0" {
		z.log.Error("control: malformed ZAP request", "frames", len(req))
		var id []byte
		if len(req) > 1 {
			id = req[1]
		}
		return reply(id, "500", "malformed ZAP request")
	}
	id, domain, address, mechanism := req[1], string(req[2]), string(req[3]), string(req[5])
	var key string
	if mechanism == mechanismCurve {
		if len(req) < 7 || len(req[6]) != curveKeyRawSize {
			return reply(id, "500", "malformed CURVE credentials")
		}
		key = zmq.Z85encode(string(req[6]))
	}
	z.mu.Lock()
	d, ok := z.domains[domain]
	z.mu.Unlock()
	if !ok {
		// A socket of this context that did not register: nothing here
		// vouches for its peers.
		return reply(id, "400", "unknown ZAP domain")
	}
	if r := d.policy.decide(address, mechanism, key); r != admitted {
		d.refused(r, address)
		return reply(id, "400", string(r))
	}
	return reply(id, "200", "OK")
}
