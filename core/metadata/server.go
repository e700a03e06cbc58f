package metadata

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
)

// Defaults applied to zero Config fields.
const (
	DefaultMaxBodyBytes = 16 << 20
	// MaxKeyLen bounds a key; Mooncake's are a prefix and a segment name.
	MaxKeyLen = 4096
	// Path is where the store answers, as in "http://host:port/metadata".
	Path = "/metadata"
)

// Config says where and how to serve.
type Config struct {
	// Addr is "host:port" to listen on; port 0 picks a free one.
	Addr string
	// Token, when set, must arrive as "Authorization: Bearer <Token>" on
	// every /metadata request.
	Token        string
	MaxBodyBytes int
	Logger       *slog.Logger
}

// Stats counts what the store has served.
type Stats struct {
	Addr         string `json:"addr"`
	URL          string `json:"url"`
	Keys         int    `json:"keys"`
	Bytes        int64  `json:"bytes"`
	Gets         uint64 `json:"gets"`
	Puts         uint64 `json:"puts"`
	Deletes      uint64 `json:"deletes"`
	NotFound     uint64 `json:"not_found"`
	BadRequests  uint64 `json:"bad_requests"`
	Unauthorized uint64 `json:"unauthorized"`
}

// Server is a running store. Its methods are safe for concurrent use.
type Server struct {
	cfg  Config
	log  *slog.Logger
	ln   net.Listener
	srv  *fasthttp.Server
	done chan struct{}

	mu    sync.RWMutex
	kv    map[string][]byte
	bytes int64

	gets, puts, deletes, notFound, badRequests, unauthorized atomic.Uint64

	closeOnce sync.Once
	closeErr  error
}

// Listen starts a store on cfg.Addr.
func Listen(cfg Config) (*Server, error) {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("metadata: listen on %s: %w", cfg.Addr, err)
	}
	s := &Server{cfg: cfg, log: cfg.Logger.With("component", "mooncake-metadata"), ln: ln, done: make(chan struct{}), kv: map[string][]byte{}}
	s.srv = &fasthttp.Server{
		Handler:            s.handle,
		Name:               "ecmooncake-metadata",
		MaxRequestBodySize: cfg.MaxBodyBytes,
		// Room for a request line carrying a MaxKeyLen key escaped in full.
		ReadBufferSize:  4*MaxKeyLen + 4096,
		ReadTimeout:     30 * time.Second,
		WriteTimeout:    30 * time.Second,
		IdleTimeout:     time.Minute,
		CloseOnShutdown: true,
		Logger:          fasthttpLog{s.log},
	}
	go s.serve()
	s.log.Info("mooncake metadata store listening", "url", s.URL())
	return s, nil
}

// Ensure serves a store on cfg.Addr, or, when that address is taken by a
// healthy store already (another shard of this host started it), returns
// nil and no error: the caller then uses that one and owns nothing.
func Ensure(cfg Config) (*Server, error) {
	s, err := Listen(cfg)
	if err == nil || !errors.Is(err, syscall.EADDRINUSE) {
		return s, err
	}
	if herr := probeHealth(cfg.Addr); herr != nil {
		return nil, fmt.Errorf("%w; and what listens there is not a metadata store: %v", err, herr)
	}
	if cfg.Logger != nil {
		cfg.Logger.Info("using the mooncake metadata store already serving", "addr", cfg.Addr)
	}
	return nil, nil
}

func probeHealth(addr string) error {
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + net.JoinHostPort(localHost(h), p) + "/health")
	if err := fasthttp.DoTimeout(req, resp, 2*time.Second); err != nil {
		return err
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return fmt.Errorf("GET /health answered %d", resp.StatusCode())
	}
	return nil
}

// localHost turns a wildcard listen host into one a local client can dial.
func localHost(h string) string {
	if ip := net.ParseIP(h); h == "" || ip != nil && ip.IsUnspecified() {
		return "127.0.0.1"
	}
	return h
}

func (s *Server) serve() {
	defer close(s.done)
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("metadata: recovered panic in the server loop", "panic", r)
		}
	}()
	if err := s.srv.Serve(s.ln); err != nil {
		s.log.Warn("metadata store stopped serving", "cause", err)
	}
}

// Addr is the address the store listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is the metadata connection string an engine on this host uses.
func (s *Server) URL() string {
	h, p, _ := net.SplitHostPort(s.Addr())
	return "http://" + net.JoinHostPort(localHost(h), p) + Path
}

// Stats returns a snapshot of the counters.
func (s *Server) Stats() Stats {
	s.mu.RLock()
	keys, n := len(s.kv), s.bytes
	s.mu.RUnlock()
	return Stats{
		Addr: s.Addr(), URL: s.URL(), Keys: keys, Bytes: n,
		Gets: s.gets.Load(), Puts: s.puts.Load(), Deletes: s.deletes.Load(),
		NotFound: s.notFound.Load(), BadRequests: s.badRequests.Load(), Unauthorized: s.unauthorized.Load(),
	}
}

// Close stops serving and waits for the server goroutine; idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.srv.ShutdownWithContext(ctx); err != nil {
			s.closeErr = fmt.Errorf("metadata: close %s: %w", s.Addr(), err)
		}
		// Shutdown closes only the listeners Serve has registered; one that
		// has not started yet must still see its listener go.
		s.ln.Close()
		<-s.done
	})
	return s.closeErr
}

func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("metadata: recovered panic in a handler", "panic", r, "uri", string(ctx.RequestURI()))
			ctx.Error("internal error", fasthttp.StatusInternalServerError)
		}
	}()
	switch string(ctx.Path()) {
	case "/health":
		if !ctx.IsGet() && !ctx.IsHead() {
			ctx.Error("method not allowed", fasthttp.StatusMethodNotAllowed)
			return
		}
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("ok")
	case Path:
		s.metadata(ctx)
	default:
		ctx.Error("not found: this server answers /metadata?key=K and /health", fasthttp.StatusNotFound)
	}
}

func (s *Server) metadata(ctx *fasthttp.RequestCtx) {
	if s.cfg.Token != "" {
		want := []byte("Bearer " + s.cfg.Token)
		if subtle.ConstantTimeCompare(ctx.Request.Header.Peek(fasthttp.HeaderAuthorization), want) != 1 {
			s.unauthorized.Add(1)
			ctx.Error("unauthorized: send Authorization: Bearer <token>", fasthttp.StatusUnauthorized)
			return
		}
	}
	args := ctx.QueryArgs()
	key := string(args.Peek("key"))
	if key == "" || len(key) > MaxKeyLen {
		s.badRequests.Add(1)
		ctx.Error(fmt.Sprintf("bad request: want ?key=K with 1 to %d bytes, got %d", MaxKeyLen, len(key)), fasthttp.StatusBadRequest)
		return
	}
	switch {
	case ctx.IsGet():
		s.gets.Add(1)
		s.mu.RLock()
		v, ok := s.kv[key]
		s.mu.RUnlock()
		if !ok {
			s.notFound.Add(1)
			ctx.Error("metadata not found", fasthttp.StatusNotFound)
			return
		}
		ctx.SetContentType("application/json")
		ctx.SetBody(v)
	case ctx.IsPut():
		body := ctx.PostBody()
		if !json.Valid(body) {
			s.badRequests.Add(1)
			ctx.Error("bad request: the body is not JSON", fasthttp.StatusBadRequest)
			return
		}
		s.puts.Add(1)
		v := bytes.Clone(body)
		s.mu.Lock()
		s.bytes += int64(len(v)) - int64(len(s.kv[key]))
		s.kv[key] = v
		s.mu.Unlock()
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("metadata updated")
	case ctx.IsDelete():
		s.deletes.Add(1)
		s.mu.Lock()
		s.bytes -= int64(len(s.kv[key]))
		delete(s.kv, key)
		s.mu.Unlock()
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("metadata deleted")
	default:
		ctx.Error("method not allowed: GET, PUT or DELETE", fasthttp.StatusMethodNotAllowed)
	}
}

// fasthttpLog routes fasthttp's own messages to slog.
type fasthttpLog struct{ log *slog.Logger }

func (l fasthttpLog) Printf(format string, args ...any) {
	l.log.Warn(fmt.Sprintf(format, args...))
}
