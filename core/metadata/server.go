package metadata

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/internal/ratelog"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// Defaults applied to zero Config fields. A Mooncake engine publishes two
// keys per segment: its RPC address (a few hundred bytes) and its segment
// descriptor, which lists every registered buffer with its keys and every
// NIC with its GID; a few KB for one slab, up to a few MB for an engine
// that registers thousands of buffers. The defaults leave two orders of
// magnitude of room above that and bound the store's memory.
const (
	DefaultMaxValueBytes = 16 << 20
	DefaultMaxKeys       = 1 << 16
	DefaultMaxTotalBytes = 256 << 20
	// DefaultMaxConns caps the connections served at once: a host's
	// engines need a few each. At the cap, a connection that has not
	// proved itself (no request with the token) and is not in a request
	// makes room for a newcomer; with none, the newcomer is answered 503
	// and closed.
	DefaultMaxConns = 1024
	// DefaultMaxConnsPerPeer caps the connections of one peer address
	// (never above MaxConns): past it, that address's own longest-waiting
	// unproven connection makes room.
	DefaultMaxConnsPerPeer = DefaultMaxConns / 4
	// headerTimeout bounds the wait for a request's header, the first
	// request's included: a connection that sends none in time is closed.
	// Only an authorized PUT's body gets bodyTimeout.
	headerTimeout = 5 * time.Second
	bodyTimeout   = 30 * time.Second
	// MaxKeyLen bounds a key; Mooncake's are a prefix and a segment name.
	MaxKeyLen = 4096
	// Path is where the store answers, as in "http://host:port/metadata".
	Path = "/metadata"
	// maxOtherBody bounds the body of every request that stores nothing
	// (GET, DELETE, /health, and any request without the token).
	maxOtherBody = 4096
	// defaultCloseGrace is how long Close lets requests in flight finish.
	defaultCloseGrace = 5 * time.Second
)

// ErrInvalid is wrapped by every configuration error.
var ErrInvalid = errors.New("invalid metadata store config")

// Config says where and how to serve.
type Config struct {
	// Addr is "host:port" to listen on; port 0 picks a free one.
	Addr string
	// Token, when set, must arrive as "Authorization: Bearer <Token>" on
	// every /metadata request. It is required unless Open is set.
	Token string
	// Open serves without a token: whoever reaches the port can rewrite
	// the segment descriptors engines connect to. Logged loudly.
	Open bool
	// MaxValueBytes bounds one value; a larger PUT is refused with 413
	// before its body is read.
	MaxValueBytes int
	// MaxKeys and MaxTotalBytes (keys and values together) bound the
	// store; a PUT that would pass either is refused with 507.
	MaxKeys       int
	MaxTotalBytes int64
	// MaxConns caps the connections served at once (DefaultMaxConns),
	// MaxConnsPerPeer those of one peer address (DefaultMaxConnsPerPeer).
	MaxConns        int
	MaxConnsPerPeer int
	Logger          *slog.Logger

	// closeGrace bounds how long Close lets requests in flight finish
	// before it ends every connection; 0 is defaultCloseGrace.
	closeGrace time.Duration
}

// withDefaults fills zero limits and checks them.
func (c Config) withDefaults() (Config, error) {
	switch {
	case c.Token == "" && !c.Open:
		return c, fmt.Errorf("%w: no token: whoever reaches the store could rewrite the segment descriptors engines connect to; "+
			"set MC_METADATA_HTTP_TOKEN (Mooncake's engines send it too) or give the command --token-file FILE, "+
			"or serve open (open: true, --open) on a host whose every user you trust", ErrInvalid)
	case c.Token != "" && c.Open:
		return c, fmt.Errorf("%w: a token and open at once; drop one", ErrInvalid)
	}
	if c.MaxValueBytes < 0 || c.MaxKeys < 0 || c.MaxTotalBytes < 0 || c.MaxConns < 0 || c.MaxConnsPerPeer < 0 {
		return c, fmt.Errorf("%w: max_value_bytes = %d, max_keys = %d, max_total_bytes = %d, max_conns = %d, max_conns_per_peer = %d; want positive values, or 0 for the defaults",
			ErrInvalid, c.MaxValueBytes, c.MaxKeys, c.MaxTotalBytes, c.MaxConns, c.MaxConnsPerPeer)
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.MaxConnsPerPeer == 0 {
		c.MaxConnsPerPeer = DefaultMaxConnsPerPeer
	}
	c.MaxConnsPerPeer = min(c.MaxConnsPerPeer, c.MaxConns)
	if c.MaxValueBytes == 0 {
		c.MaxValueBytes = DefaultMaxValueBytes
	}
	if c.MaxKeys == 0 {
		c.MaxKeys = DefaultMaxKeys
	}
	if c.MaxTotalBytes == 0 {
		c.MaxTotalBytes = DefaultMaxTotalBytes
	}
	if int64(c.MaxValueBytes) > c.MaxTotalBytes {
		return c, fmt.Errorf("%w: max_value_bytes = %d is above max_total_bytes = %d; no value that large could be stored",
			ErrInvalid, c.MaxValueBytes, c.MaxTotalBytes)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.closeGrace <= 0 {
		c.closeGrace = defaultCloseGrace
	}
	return c, nil
}

// Stats counts what the store has served.
type Stats struct {
	Addr string `json:"addr"`
	URL  string `json:"url"`
	Keys int    `json:"keys"`
	// Bytes counts keys and values, what MaxTotalBytes bounds.
	Bytes         int64  `json:"bytes"`
	MaxKeys       int    `json:"max_keys"`
	MaxValueBytes int    `json:"max_value_bytes"`
	MaxTotalBytes int64  `json:"max_total_bytes"`
	Gets          uint64 `json:"gets"`
	Puts          uint64 `json:"puts"`
	Deletes       uint64 `json:"deletes"`
	NotFound      uint64 `json:"not_found"`
	BadRequests   uint64 `json:"bad_requests"`
	Unauthorized  uint64 `json:"unauthorized"`
	TooLarge      uint64 `json:"too_large"`
	StoreFull     uint64 `json:"store_full"`
	// Conns is the connections open now.
	Conns int `json:"conns"`
	// EvictedConns counts unproven idle connections closed to make room
	// for a newcomer; RejectedConns the newcomers refused (503) because
	// every place was held by a proven connection or one in a request.
	EvictedConns  uint64 `json:"evicted_conns"`
	RejectedConns uint64 `json:"rejected_conns"`
}

// Server is a running store. Its methods are safe for concurrent use.
type Server struct {
	cfg   Config
	log   *slog.Logger
	ln    net.Listener
	conns *connSet // what ln accepted and has not closed
	srv   *fasthttp.Server
	done  chan struct{}

	token    [sha256.Size]byte // digest of cfg.Token, when set
	refusals ratelog.Limiter

	mu    sync.RWMutex
	kv    map[string][]byte
	bytes int64 // keys and values

	gets, puts, deletes, notFound, badRequests, unauthorized, tooLarge, storeFull atomic.Uint64

	unwatch func()

	closeOnce sync.Once
	closeErr  error
}

// newServer builds the store without a listener (Listen adds it; the
// fuzz target drives the handler directly).
func newServer(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger.With("component", "mooncake-metadata"), done: make(chan struct{}), kv: map[string][]byte{},
		conns: newConnSet(cfg.MaxConns, cfg.MaxConnsPerPeer)}
	if cfg.Token != "" {
		s.token = sha256.Sum256([]byte(cfg.Token))
	}
	s.srv = &fasthttp.Server{
		Handler:            s.handle,
		Name:               "ecmooncake-metadata",
		MaxRequestBodySize: cfg.MaxValueBytes,
		HeaderReceived:     s.bodyLimit,
		ErrorHandler:       s.readError,
		// Room for a request line carrying a MaxKeyLen key escaped in full.
		ReadBufferSize: 4*MaxKeyLen + 4096,
		ReadTimeout:    headerTimeout,
		WriteTimeout:   30 * time.Second,
		IdleTimeout:    time.Minute,
		// The cap is the listener's (connSet); fasthttp's own is a
		// backstop with room for the workers of closed connections that
		// are still unwinding.
		Concurrency:     2 * cfg.MaxConns,
		CloseOnShutdown: true,
		Logger:          fasthttpLog{s.log},
	}
	return s, nil
}

// Listen starts a store on cfg.Addr.
func Listen(cfg Config) (*Server, error) {
	s, err := newServer(cfg)
	if err != nil {
		return nil, err
	}
	if s.ln, err = net.Listen("tcp", cfg.Addr); err != nil {
		return nil, fmt.Errorf("metadata: listen on %s: %w", cfg.Addr, err)
	}
	s.unwatch = metrics.Watch("metadata:"+strconv.Itoa(s.ln.Addr().(*net.TCPAddr).Port), s.probe)
	go s.serve()
	s.log.Info("mooncake metadata store listening", "url", s.URL(), "token", s.cfg.Token != "",
		"max_keys", s.cfg.MaxKeys, "max_value_bytes", s.cfg.MaxValueBytes, "max_total_bytes", s.cfg.MaxTotalBytes)
	if s.cfg.Open {
		where := "every user of this host"
		if !loopback(s.ln.Addr()) {
			where = "anybody who reaches " + s.Addr()
		}
		s.log.Warn("SECURITY: mooncake metadata store serves open, without a token: "+where+
			" can rewrite the segment descriptors engines connect to; set MC_METADATA_HTTP_TOKEN (engines send it too)",
			"addr", s.Addr())
	}
	return s, nil
}

// probe reports the store's size and refusals at scrape time.
func (s *Server) probe(e *metrics.Emitter) {
	st := s.Stats()
	e.Set(metrics.MetadataKeys, float64(st.Keys))
	e.Set(metrics.MetadataBytes, float64(st.Bytes))
	e.Set(metrics.MetadataRefusals, float64(st.Unauthorized), "unauthorized")
	e.Set(metrics.MetadataRefusals, float64(st.TooLarge), "too_large")
	e.Set(metrics.MetadataRefusals, float64(st.StoreFull), "store_full")
	e.Set(metrics.MetadataRefusals, float64(st.BadRequests), "bad_request")
	e.Set(metrics.MetadataRefusals, float64(st.EvictedConns), "conn_evicted")
	e.Set(metrics.MetadataRefusals, float64(st.RejectedConns), "conn_refused")
}

func loopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
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
	if err := s.srv.Serve(trackedListener{Listener: s.ln, set: s.conns, onVictim: s.connClosed}); err != nil {
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
		MaxKeys: s.cfg.MaxKeys, MaxValueBytes: s.cfg.MaxValueBytes, MaxTotalBytes: s.cfg.MaxTotalBytes,
		Gets: s.gets.Load(), Puts: s.puts.Load(), Deletes: s.deletes.Load(),
		NotFound: s.notFound.Load(), BadRequests: s.badRequests.Load(), Unauthorized: s.unauthorized.Load(),
		TooLarge: s.tooLarge.Load(), StoreFull: s.storeFull.Load(),
		Conns: s.conns.len(), EvictedConns: s.conns.evicted.Load(),
		RejectedConns: s.conns.refused.Load() + uint64(s.srv.GetRejectedConnectionsCount()),
	}
}

// connClosed logs, at most once per interval per reason, a connection
// closed to keep the limits.
func (s *Server) connClosed(c *trackedConn, why string, refused bool) {
	reason := why + "_evicted"
	if refused {
		reason = why + "_refused"
	}
	if ok, suppressed := s.refusals.Admit(reason, time.Now()); ok {
		s.log.Warn("metadata: at a connection limit", "reason", reason, "peer", c.peer,
			"max_conns", s.cfg.MaxConns, "max_conns_per_peer", s.cfg.MaxConnsPerPeer,
			"detail", "an unproven idle connection makes room; with none, the newcomer is refused",
			"refusals_not_logged", suppressed)
	}
}

// Close stops serving and waits for the server goroutine; idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.closeGrace)
		defer cancel()
		switch err := s.srv.ShutdownWithContext(ctx); {
		case errors.Is(err, context.DeadlineExceeded):
			// Past the grace, what is still open ends now: requests that
			// outlived it, and connections that never sent one (which
			// fasthttp would keep for five seconds).
			n := s.conns.closeAll()
			s.log.Info("metadata: closed the connections still open after the close grace", "conns", n, "grace", s.cfg.closeGrace)
		case err != nil:
			s.closeErr = fmt.Errorf("metadata: close %s: %w", s.Addr(), err)
		}
		// Shutdown closes only the listeners Serve has registered; one that
		// has not started yet must still see its listener go.
		s.ln.Close()
		<-s.done
		s.unwatch()
	})
	return s.closeErr
}

func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	// While it is in a request, a connection never makes room for a
	// newcomer; one that brought the token never does.
	if tc, ok := ctx.Conn().(*trackedConn); ok {
		s.conns.busy(tc, true, s.cfg.Token != "" && s.authorized(&ctx.Request.Header), time.Now())
		defer func() { s.conns.busy(tc, false, false, time.Now()) }()
	}
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

// authorized reports whether a request may use /metadata. Digests of
// equal length are compared in constant time, so a refusal tells nothing
// about the token's length or a prefix of it.
func (s *Server) authorized(h *fasthttp.RequestHeader) bool {
	if s.cfg.Token == "" {
		return true
	}
	got, ok := bytes.CutPrefix(h.Peek(fasthttp.HeaderAuthorization), []byte("Bearer "))
	if !ok {
		return false
	}
	sum := sha256.Sum256(got)
	return subtle.ConstantTimeCompare(sum[:], s.token[:]) == 1
}

// bodyLimit runs once the header is read, before the body: only an
// authorized PUT may send a value, so no other request makes the store
// buffer more than a few KB.
func (s *Server) bodyLimit(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	if h.IsPut() && s.authorized(h) {
		return fasthttp.RequestConfig{MaxRequestBodySize: s.cfg.MaxValueBytes, ReadTimeout: bodyTimeout}
	}
	return fasthttp.RequestConfig{MaxRequestBodySize: maxOtherBody}
}

// readError answers a request fasthttp could not read: a body above its
// limit is a 413, or a 401 when the limit was the one for requests
// without the token.
func (s *Server) readError(ctx *fasthttp.RequestCtx, err error) {
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge) && !s.authorized(&ctx.Request.Header):
		s.refuseUnauthorized(ctx)
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		s.tooLarge.Add(1)
		s.refuse(ctx, "too_large", fasthttp.StatusRequestEntityTooLarge,
			fmt.Sprintf("value too large: a value is at most %d bytes (max_value_bytes)", s.cfg.MaxValueBytes))
	default:
		s.badRequests.Add(1)
		ctx.Error("bad request: "+err.Error(), fasthttp.StatusBadRequest)
	}
}

func (s *Server) refuseUnauthorized(ctx *fasthttp.RequestCtx) {
	s.unauthorized.Add(1)
	ctx.Response.Header.Set(fasthttp.HeaderWWWAuthenticate, "Bearer")
	s.refuse(ctx, "unauthorized", fasthttp.StatusUnauthorized, "unauthorized: send Authorization: Bearer <token> (the store's MC_METADATA_HTTP_TOKEN)")
}

// refuse answers and logs a refusal, at most once per interval per reason.
func (s *Server) refuse(ctx *fasthttp.RequestCtx, reason string, status int, msg string) {
	if ok, suppressed := s.refusals.Admit(reason, time.Now()); ok {
		s.log.Warn("metadata request refused", "reason", reason, "status", status, "remote", ctx.RemoteAddr().String(),
			"detail", msg, "refusals_not_logged", suppressed)
	}
	ctx.Error(msg, status)
}

// entrySize is what one key costs against MaxTotalBytes.
func entrySize(key string, v []byte) int64 { return int64(len(key) + len(v)) }

func (s *Server) metadata(ctx *fasthttp.RequestCtx) {
	if !s.authorized(&ctx.Request.Header) {
		s.refuseUnauthorized(ctx)
		return
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
		if len(body) > s.cfg.MaxValueBytes {
			// fasthttp refuses these before reading; this keeps the
			// invariant for a handler driven without it.
			s.tooLarge.Add(1)
			s.refuse(ctx, "too_large", fasthttp.StatusRequestEntityTooLarge,
				fmt.Sprintf("value too large: %d bytes; a value is at most %d bytes (max_value_bytes)", len(body), s.cfg.MaxValueBytes))
			return
		}
		// Room is checked before the JSON is, so that a full store spends
		// nothing on values it will refuse, and again when storing.
		msg := s.room(key, body)
		if msg == "" && !json.Valid(body) {
			s.badRequests.Add(1)
			ctx.Error("bad request: the body is not JSON", fasthttp.StatusBadRequest)
			return
		}
		if msg == "" {
			msg = s.put(key, body)
		}
		if msg != "" {
			s.storeFull.Add(1)
			s.refuse(ctx, "store_full", fasthttp.StatusInsufficientStorage, msg)
			return
		}
		s.puts.Add(1)
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("metadata updated")
	case ctx.IsDelete():
		s.deletes.Add(1)
		s.mu.Lock()
		if old, ok := s.kv[key]; ok {
			s.bytes -= entrySize(key, old)
			delete(s.kv, key)
		}
		s.mu.Unlock()
		ctx.SetContentType("text/plain; charset=utf-8")
		ctx.SetBodyString("metadata deleted")
	default:
		ctx.Error("method not allowed: GET, PUT or DELETE", fasthttp.StatusMethodNotAllowed)
	}
}

// put stores a value, or says why the store has no room for it. An
// overwrite never counts against MaxKeys: an engine that restarts must be
// able to publish under its key again.
func (s *Server) put(key string, body []byte) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	after, msg := s.fits(key, body)
	if msg == "" {
		s.kv[key] = bytes.Clone(body)
		s.bytes = after
	}
	return msg
}

func (s *Server) room(key string, body []byte) string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	_, msg := s.fits(key, body)
	return msg
}

// fits says what the store's bytes would be with key set to body, or why
// it has no room; s.mu is held.
func (s *Server) fits(key string, body []byte) (int64, string) {
	old, had := s.kv[key]
	if !had && len(s.kv) >= s.cfg.MaxKeys {
		return 0, fmt.Sprintf("store full: it holds %d keys, the most it keeps (max_keys); delete keys or raise the limit", len(s.kv))
	}
	after := s.bytes + entrySize(key, body)
	if had {
		after -= entrySize(key, old)
	}
	if after > s.cfg.MaxTotalBytes {
		return 0, fmt.Sprintf("store full: %d of %d bytes used (max_total_bytes) and this key and value need %d", s.bytes, s.cfg.MaxTotalBytes, entrySize(key, body))
	}
	return after, ""
}

// fasthttpLog routes fasthttp's own messages to slog at debug level: it
// logs every connection it closes after an error, which would repeat each
// refusal that refuse already logged (rate-limited).
type fasthttpLog struct{ log *slog.Logger }

func (l fasthttpLog) Printf(format string, args ...any) {
	l.log.Debug(fmt.Sprintf(format, args...))
}
