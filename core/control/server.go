package control

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"runtime/debug"
	"sync"

	zmq "github.com/pebbe/zmq4"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Handler answers decoded, version-checked requests of a known op. It is
// called on the server's goroutine, one request at a time: it must be fast
// and do no I/O, or every caller of the shard waits behind it. The server
// stamps the reply's version and id, so a handler need not.
type Handler interface {
	Handle(req wire.Request) wire.Reply
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(req wire.Request) wire.Reply

// Handle calls f.
func (f HandlerFunc) Handle(req wire.Request) wire.Reply { return f(req) }

// ServerStats counts what a server answered.
type ServerStats struct {
	Served       uint64            // requests answered, successfully or not
	Errors       map[string]uint64 // error replies by code
	SendFailures uint64            // replies libzmq refused (the caller is gone or not reading)
}

// Server is a ROUTER socket that answers requests with a Handler.
type Server struct {
	*owner
	sock     *zmq.Socket // owner goroutine only, once NewServer returns
	h        Handler
	endpoint string

	mu    sync.Mutex
	stats ServerStats
}

// NewServer binds a ROUTER to bind ("tcp://host:port"; host "*" for every
// interface, port 0 for any free port) and serves it on a new goroutine
// until Close. A hostname is bound on every address it resolves to, so that
// a client resolving it either way reaches the server.
func NewServer(zctx *zmq.Context, bind string, h Handler, log *slog.Logger) (*Server, error) {
	host, port, err := SplitEndpoint(bind)
	if err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("control: new server: nil handler")
	}
	sock, err := newSocket(zctx, zmq.ROUTER)
	if err != nil {
		return nil, err
	}
	endpoint, err := bindAll(sock, host, port, log)
	if err != nil {
		sock.Close()
		return nil, err
	}
	w, err := newWaker(zctx)
	if err != nil {
		sock.Close()
		return nil, err
	}
	s := &Server{
		owner:    newOwner(log, "server "+endpoint, w),
		sock:     sock,
		h:        h,
		endpoint: endpoint,
		stats:    ServerStats{Errors: map[string]uint64{}},
	}
	// Handing sock to the new goroutine is the one move of ownership; the
	// go statement orders everything above before it.
	go s.run(s.serve, sock)
	return s, nil
}

// bindAll binds sock to every address of host and returns the endpoint
// with the port actually bound: the host as given, or for the wildcard the
// address libzmq reports.
func bindAll(sock *zmq.Socket, host string, port int, log *slog.Logger) (string, error) {
	addrs := resolve(host)
	first := Endpoint(addrs[0], port)
	if err := sock.Bind(first); err != nil {
		return "", fmt.Errorf("control: bind %s: %w", first, err)
	}
	last, err := sock.GetLastEndpoint()
	if err != nil {
		return "", fmt.Errorf("control: bind %s: %w", first, err)
	}
	_, bound, err := SplitEndpoint(last)
	if err != nil {
		return "", err
	}
	for _, a := range addrs[1:] {
		// Best effort: a name may list an address family the host lacks.
		if err := sock.Bind(Endpoint(a, bound)); err != nil && log != nil {
			log.Warn("control: bind extra address failed", "host", host, "addr", a, "err", err)
		}
	}
	if host == "*" {
		return unmapped(last), nil
	}
	return Endpoint(host, bound), nil
}

// Endpoint is where the server listens, with the port it actually got.
func (s *Server) Endpoint() string { return s.endpoint }

// Close stops the server and closes its socket. Idempotent.
func (s *Server) Close() error {
	s.stop()
	return nil
}

// Stats returns a snapshot of the counters.
func (s *Server) Stats() ServerStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.stats
	out.Errors = maps.Clone(s.stats.Errors)
	return out
}

func (s *Server) serve() error {
	p := zmq.NewPoller()
	p.Add(s.sock, zmq.POLLIN)
	p.Add(s.wake.rx, zmq.POLLIN)
	for !s.quitting() {
		polled, err := poll(p)
		if err != nil {
			return err
		}
		for _, ev := range polled {
			switch ev.Socket {
			case s.wake.rx:
				s.wake.drain()
			case s.sock:
				if err := s.serveBatch(); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func (s *Server) serveBatch() error {
	for range recvBatch {
		parts, err := s.sock.RecvMessageBytes(zmq.DONTWAIT)
		if isAgain(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		s.serveOne(parts)
	}
	return nil
}

// serveOne answers one message. parts[0] is the caller's identity, added
// by ROUTER; our protocol puts exactly one frame after it.
func (s *Server) serveOne(parts [][]byte) {
	if len(parts) < 2 {
		return
	}
	var rep wire.Reply
	if len(parts) != 2 {
		req, _ := wire.DecodeRequest(parts[len(parts)-1])
		rep = wire.ErrReply(req.ID, wire.CodeBadRequest, fmt.Sprintf("want one frame per message, got %d", len(parts)-1))
	} else {
		rep = s.answer(parts[1])
	}
	frame, err := wire.EncodeReply(rep)
	if err != nil {
		code := wire.CodeInternal
		if errors.Is(err, wire.ErrTooLarge) {
			code = wire.CodeTooLarge
		}
		rep = wire.ErrReply(rep.ID, code, err.Error())
		frame, err = wire.EncodeReply(rep)
		if err != nil {
			s.log.Error("control: cannot encode error reply", "id", rep.ID, "err", err)
			return
		}
	}
	// Counted before sending, so that a caller holding the reply sees it
	// in Stats.
	s.mu.Lock()
	s.stats.Served++
	if rep.Err != nil {
		s.stats.Errors[rep.Err.Code]++
	}
	s.mu.Unlock()
	if _, err := s.sock.SendMessageDontwait(parts[0], frame); err != nil {
		s.mu.Lock()
		s.stats.SendFailures++
		s.mu.Unlock()
		s.log.Debug("control: reply not sent", "id", rep.ID, "err", err)
	}
}

func (s *Server) answer(frame []byte) wire.Reply {
	req, err := wire.DecodeRequest(frame)
	if err != nil {
		s.log.Debug("control: refused request", "id", req.ID, "err", err)
		return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
	}
	rep := s.handle(req)
	rep.V = wire.Version
	rep.ID = req.ID
	return rep
}

// handle calls the handler; a panic answers CodeInternal and the server
// keeps serving, since one bad request must not take down a shard.
func (s *Server) handle(req wire.Request) (rep wire.Reply) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("control: handler panicked", "op", req.Op, "id", req.ID, "panic", r, "stack", string(debug.Stack()))
			rep = wire.ErrReply(req.ID, wire.CodeInternal, fmt.Sprintf("%s handler failed", req.Op))
		}
	}()
	return s.h.Handle(req)
}

// unmapped rewrites an IPv4-mapped IPv6 endpoint (what libzmq reports for
// an IPv4 bind once IPv6 is on) in plain IPv4 form.
func unmapped(ep string) string {
	host, port, err := SplitEndpoint(ep)
	if err != nil {
		return ep
	}
	if ip := net.ParseIP(host); ip != nil && ip.To4() != nil {
		return Endpoint(ip.To4().String(), port)
	}
	return ep
}
