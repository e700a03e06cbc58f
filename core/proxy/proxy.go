package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/ecmooncake/ecmooncake/core/internal/ratelog"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// Proxy is the EPD front: an OpenAI-compatible HTTP server that sends
// media to encoders, tells them which consumer to push to, and forwards
// the rewritten request to that consumer. Its methods are safe for
// concurrent use.
type Proxy struct {
	cfg Config
	log *slog.Logger
	m   *proxyMetrics

	enc, pd, prefill, dec *pool

	auth    adminAuth
	bodies  *bodyBudget
	aff     *affinity
	refused ratelog.Limiter

	ln         net.Listener
	srv        *fasthttp.Server
	metricsSrv *metrics.Server
	// adminLn and adminSrv serve discovery when Config.AdminPort is set.
	adminLn  net.Listener
	adminSrv *fasthttp.Server

	idBase string
	seq    atomic.Uint64
	served atomic.Uint64

	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error

	warned sync.Map // causes already logged by warnOnce
}

// warnOnce logs a warning the first time cause is seen; the metric that
// goes with it counts every occurrence.
func (p *Proxy) warnOnce(cause, msg string, args ...any) {
	if _, seen := p.warned.LoadOrStore(cause, true); !seen {
		p.log.Warn(msg, args...)
	}
}

// Open validates cfg, starts listening and returns at once; the health
// checker runs in the background.
func Open(cfg Config, log *slog.Logger) (p *Proxy, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	var idb [6]byte
	if _, err := rand.Read(idb[:]); err != nil {
		return nil, fmt.Errorf("proxy: request id seed: %w", err)
	}
	p = &Proxy{
		cfg: cfg, log: log.With("role", "proxy"), idBase: hex.EncodeToString(idb[:]),
		stop: make(chan struct{}),
		auth: newAdminAuth(cfg.RegisterToken), bodies: newBodyBudget(cfg.bodyBudget(), cfg.maxBodyBytesPerClient()),
		aff: newAffinity(cfg.AffinityEntries, secs(cfg.AffinityTTLS)),
	}
	p.m = newProxyMetrics(p)
	up := upstreamConfig{idleTimeout: cfg.upstreamIdleTimeout(), redialed: func(role string) { p.m.redials.WithLabelValues(role).Inc() }}
	p.enc = &pool{role: discovery.RoleEncode, threshold: cfg.FailThreshold, up: up}
	p.pd = &pool{role: discovery.RolePD, threshold: cfg.FailThreshold, up: up}
	p.prefill = &pool{role: discovery.RolePrefill, threshold: cfg.FailThreshold, up: up}
	p.dec = &pool{role: discovery.RoleDecode, threshold: cfg.FailThreshold, up: up}
	now := time.Now()
	for role, urls := range map[string][]string{discovery.RoleEncode: cfg.Encode, discovery.RolePD: cfg.PD, discovery.RolePrefill: cfg.Prefill, discovery.RoleDecode: cfg.Decode} {
		for _, u := range urls {
			reg, err := cfg.static(role, u)
			if err != nil {
				return nil, err
			}
			if _, _, err := p.poolOf(role).add(reg, true, 0, now); err != nil {
				return nil, err
			}
		}
	}
	// p is the named result, nil on an error return: what listen opened
	// is closed from this list.
	var opened []net.Listener
	defer func() {
		if err != nil {
			for _, ln := range opened {
				_ = ln.Close()
			}
		}
	}()
	listen := func(what, host string, port int) (net.Listener, error) {
		at := net.JoinHostPort(host, strconv.Itoa(port))
		ln, err := net.Listen("tcp", at)
		if err != nil {
			return nil, fmt.Errorf("proxy: %slisten on %s: %w", what, at, err)
		}
		opened = append(opened, ln)
		return ln, nil
	}
	if p.ln, err = listen("", cfg.Host, cfg.Port); err != nil {
		return nil, err
	}
	if cfg.AdminPort != 0 {
		host := cfg.AdminHost
		if host == "" {
			host = cfg.Host
		}
		if p.adminLn, err = listen("admin port: ", host, cfg.AdminPort); err != nil {
			return nil, err
		}
	}
	if cfg.MetricsPort != 0 {
		if p.metricsSrv, err = metrics.Serve(cfg.Host, cfg.MetricsPort, p.m.gatherer, p.log); err != nil {
			return nil, fmt.Errorf("proxy: %w", err)
		}
	}
	p.srv = &fasthttp.Server{
		Name:               "ecmooncake-proxy",
		Handler:            p.handle,
		MaxRequestBodySize: cfg.MaxBodyBytes,
		// The handler reads each body under the budget of body bytes in
		// flight (takeBody), as it arrives.
		StreamRequestBody:             true,
		ReadTimeout:                   time.Minute,
		IdleTimeout:                   90 * time.Second,
		NoDefaultServerHeader:         true,
		NoDefaultContentType:          true,
		DisableHeaderNamesNormalizing: false,
		CloseOnShutdown:               true,
		HeaderReceived:                discoveryLimit,
		ErrorHandler:                  p.readError,
		Logger:                        quietLogger{p.log},
	}
	p.wg.Add(2)
	go p.serve(p.srv, p.ln)
	go p.healthLoop()
	if p.adminLn != nil {
		p.adminSrv = &fasthttp.Server{
			Name:                  "ecmooncake-proxy-admin",
			Handler:               p.handleAdmin,
			MaxRequestBodySize:    maxDiscoveryBody,
			HeaderReceived:        discoveryLimit,
			ErrorHandler:          p.readError,
			ReadTimeout:           30 * time.Second,
			IdleTimeout:           90 * time.Second,
			NoDefaultServerHeader: true,
			NoDefaultContentType:  true,
			CloseOnShutdown:       true,
			Logger:                quietLogger{p.log},
		}
		p.wg.Add(1)
		go p.serve(p.adminSrv, p.adminLn)
	}
	discoveryAt := "off"
	switch {
	case !cfg.Discovery():
	case p.adminLn != nil:
		discoveryAt = "admin port " + p.adminLn.Addr().String()
	default:
		discoveryAt = "main port"
	}
	p.log.Info("proxy listening", "addr", p.ln.Addr().String(), "encoders", len(cfg.Encode), "pd", len(cfg.PD),
		"prefill", len(cfg.Prefill), "decode", len(cfg.Decode), "retries", cfg.Retries, "registration", discoveryAt)
	if cfg.Discovery() && len(cfg.RegisterToken) < 16 {
		p.log.Warn("the register token is short; anyone who guesses it can add backends", "length", len(cfg.RegisterToken), "want_at_least", 16)
	}
	return p, nil
}

// Addr is where the proxy listens.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// AdminAddr is where the admin port listens, or "" when discovery is
// served on the main port.
func (p *Proxy) AdminAddr() string {
	if p.adminLn == nil {
		return ""
	}
	return p.adminLn.Addr().String()
}

// MetricsAddr is where the metrics port listens, or "" when it is off.
func (p *Proxy) MetricsAddr() string {
	if p.metricsSrv == nil {
		return ""
	}
	return p.metricsSrv.Addr()
}

func (p *Proxy) serve(srv *fasthttp.Server, ln net.Listener) {
	defer p.wg.Done()
	defer p.recover("serve")
	if err := srv.Serve(ln); err != nil {
		p.log.Warn("proxy server stopped", "cause", err)
	}
}

func (p *Proxy) recover(what string) {
	if r := recover(); r != nil {
		p.log.Error("proxy: recovered panic", "in", what, "panic", r)
	}
}

func (p *Proxy) poolOf(role string) *pool {
	switch role {
	case discovery.RoleEncode:
		return p.enc
	case discovery.RolePrefill:
		return p.prefill
	case discovery.RoleDecode:
		return p.dec
	default:
		return p.pd
	}
}

func (p *Proxy) pools() []*pool { return []*pool{p.enc, p.pd, p.prefill, p.dec} }

// split reports whether requests go to a prefill and a decode instance:
// configured so, or only prefill instances have registered.
func (p *Proxy) split() bool {
	if p.cfg.Split() {
		return true
	}
	return len(p.pd.snapshot()) == 0 && len(p.prefill.snapshot()) > 0
}

// consumers is the pool whose instances receive encoder outputs.
func (p *Proxy) consumers() *pool {
	if p.split() {
		return p.prefill
	}
	return p.pd
}

// healthLoop drops lapsed registrations and checks every backend's
// /health each interval.
func (p *Proxy) healthLoop() {
	defer p.wg.Done()
	t := time.NewTicker(p.cfg.healthInterval())
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		p.checkAll()
	}
}

func (p *Proxy) checkAll() {
	defer p.recover("health")
	now := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.healthTimeout())
	defer cancel()
	var wg sync.WaitGroup
	for _, pl := range p.pools() {
		for _, url := range pl.expire(now) {
			p.m.registers.WithLabelValues("expired").Inc()
			p.log.Warn("registration lapsed: no heartbeat within its ttl", "role", pl.role, "url", url)
		}
		for _, b := range pl.snapshot() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer p.recover("health check")
				err := checkHealth(ctx, b, p.cfg.healthTimeout())
				outcome := "ok"
				if err != nil {
					outcome = "failed"
				}
				p.m.checks.WithLabelValues(pl.role, outcome).Inc()
				p.noteHealth(pl, b, err)
			}()
		}
	}
	wg.Wait()
}

// noteHealth records an outcome and logs when a backend is dropped or
// re-admitted.
func (p *Proxy) noteHealth(pl *pool, b *backend, err error) {
	changed, healthy := pl.report(b, err)
	switch {
	case changed && healthy:
		p.log.Info("backend re-admitted", "role", pl.role, "url", b.reg.URL)
	case changed:
		p.log.Warn("backend dropped after repeated failures", "role", pl.role, "url", b.reg.URL, "cause", err)
	}
}

// Stats are the proxy's counters.
type Stats struct {
	Addr        string                   `json:"addr"`
	AdminAddr   string                   `json:"admin_addr,omitempty"`
	MetricsAddr string                   `json:"metrics_addr,omitempty"`
	Served      uint64                   `json:"requests_served"`
	Backends    map[string][]BackendInfo `json:"backends"`
}

// Stats returns a snapshot.
func (p *Proxy) Stats() Stats {
	return Stats{Addr: p.Addr(), AdminAddr: p.AdminAddr(), MetricsAddr: p.MetricsAddr(), Served: p.served.Load(), Backends: p.backends()}
}

func (p *Proxy) backends() map[string][]BackendInfo {
	now := time.Now()
	out := map[string][]BackendInfo{}
	for _, pl := range p.pools() {
		list := []BackendInfo{}
		for _, b := range pl.snapshot() {
			list = append(list, b.info(now))
		}
		out[pl.role] = list
	}
	return out
}

// Close stops accepting requests, ends those in flight (their backend
// calls are cancelled) and waits, up to a deadline, for every goroutine.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		close(p.stop)
		var errs []error
		done := make(chan error, 1)
		go func() {
			err := p.srv.Shutdown()
			if p.adminSrv != nil {
				err = errors.Join(err, p.adminSrv.Shutdown())
			}
			// Shutdown closes only the listeners Serve has taken; one
			// whose Serve has not started yet must still go.
			_ = p.ln.Close()
			if p.adminLn != nil {
				_ = p.adminLn.Close()
			}
			done <- err
		}()
		t := time.NewTimer(10 * time.Second)
		defer t.Stop()
		select {
		case err := <-done:
			errs = append(errs, err)
		case <-t.C:
			errs = append(errs, errors.New("proxy: requests still running 10s after close"))
		}
		if p.metricsSrv != nil {
			errs = append(errs, p.metricsSrv.Close())
		}
		wait := make(chan struct{})
		go func() { p.wg.Wait(); close(wait) }()
		select {
		case <-wait:
		case <-t.C:
			errs = append(errs, errors.New("proxy: background goroutines still running after close"))
		}
		for _, pl := range p.pools() {
			for _, b := range pl.snapshot() {
				b.up.close()
			}
		}
		if err := errors.Join(errs...); err != nil {
			p.closeErr = fmt.Errorf("proxy: close: %w", err)
		}
	})
	return p.closeErr
}

// newTransferID mints a transfer id: 128 bits from crypto/rand. It names a
// grant at every shard, so unlike the request id (which every client sees
// as X-Request-Id) it must not be derivable from anything a client sees.
func newTransferID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on Linux (getrandom); if it ever did,
		// a guessable id would be worse than no request.
		panic(fmt.Sprintf("proxy: crypto/rand: %v", err))
	}
	return "ecm-t-" + hex.EncodeToString(b[:])
}

func (p *Proxy) newID() string {
	return fmt.Sprintf("ecm-%s-%d", p.idBase, p.seq.Add(1))
}

// quietLogger routes fasthttp's own messages to slog at debug level.
type quietLogger struct{ log *slog.Logger }

func (q quietLogger) Printf(format string, args ...any) { q.log.Debug(fmt.Sprintf(format, args...)) }
