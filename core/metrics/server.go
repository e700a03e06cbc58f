package metrics

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// Server serves /metrics (Prometheus text) and /health on one port.
type Server struct {
	ln   net.Listener
	srv  *fasthttp.Server
	done chan struct{}
	once sync.Once
	err  error
}

// Serve listens on ip:port (port 0 picks a free one) and serves g, or this
// process's registry when g is nil.
func Serve(ip string, port int, g prometheus.Gatherer, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	addr := net.JoinHostPort(ip, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w", addr, err)
	}
	s := &Server{ln: ln, done: make(chan struct{})}
	s.srv = &fasthttp.Server{
		Name:         "ecmooncake",
		Handler:      Handler(g, nil),
		ReadTimeout:  30 * time.Second,
		WriteTimeout: 30 * time.Second,
		IdleTimeout:  time.Minute,
		Logger:       quietLogger{log},
	}
	go func() {
		defer close(s.done)
		defer func() {
			if r := recover(); r != nil {
				log.Error("metrics: recovered panic in server", "panic", r)
			}
		}()
		if err := s.srv.Serve(ln); err != nil {
			log.Warn("metrics server stopped", "addr", addr, "cause", err)
		}
	}()
	log.Info("serving metrics", "addr", ln.Addr().String())
	return s, nil
}

// Addr is where the server listens.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server and waits, up to a deadline, for it to finish.
func (s *Server) Close() error {
	s.once.Do(func() {
		errc := make(chan error, 1)
		go func() { errc <- s.srv.Shutdown() }()
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		select {
		case s.err = <-errc:
		case <-t.C:
			s.err = errors.Join(errors.New("metrics: server did not stop within 5s"), s.ln.Close())
		}
		select {
		case <-s.done:
		case <-t.C:
		}
	})
	return s.err
}

// Handler serves /metrics from g (nil: this process's registry), /health
// with 200, and passes anything else to next (404 when next is nil).
func Handler(g prometheus.Gatherer, next fasthttp.RequestHandler) fasthttp.RequestHandler {
	return func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/metrics":
			Write(ctx, g)
		case "/health":
			ctx.SetStatusCode(fasthttp.StatusOK)
		default:
			if next != nil {
				next(ctx)
				return
			}
			ctx.Error("not found", fasthttp.StatusNotFound)
		}
	}
}

// Write answers a scrape.
func Write(ctx *fasthttp.RequestCtx, g prometheus.Gatherer) {
	body, err := Text(g)
	if err != nil && len(body) == 0 {
		ctx.Error(err.Error(), fasthttp.StatusInternalServerError)
		return
	}
	ctx.SetContentType("text/plain; version=0.0.4; charset=utf-8")
	ctx.SetBody(body)
}

// quietLogger routes fasthttp's own messages to slog at debug level:
// a client that drops a connection is not worth a warning.
type quietLogger struct{ log *slog.Logger }

func (q quietLogger) Printf(format string, args ...any) {
	q.log.Debug(fmt.Sprintf(format, args...))
}
