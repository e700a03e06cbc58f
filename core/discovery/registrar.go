package discovery

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// RegistrarConfig says where to register and what.
type RegistrarConfig struct {
	// Proxies are the base URLs of every proxy to register with.
	Proxies []string `json:"proxies"`
	Registration
	// IntervalS is the heartbeat period; 0 means a third of the TTL.
	IntervalS float64 `json:"interval_s"`
	// Token is the proxies' register token, sent as a bearer token with
	// every registration and deregistration.
	Token string `json:"token"`
}

// DefaultTTL is the entry lifetime when the registration gives none.
const DefaultTTL = 10 * time.Second

// DecodeRegistrarConfig decodes and validates a registrar's settings.
func DecodeRegistrarConfig(raw []byte) (RegistrarConfig, error) {
	var c RegistrarConfig
	if err := strictDecoder(raw).Decode(&c); err != nil {
		return c, fmt.Errorf("%w: registrar settings: %v", ErrInvalid, err)
	}
	return c, c.Normalize()
}

// Normalize fills defaults and validates.
func (c *RegistrarConfig) Normalize() error {
	if len(c.Proxies) == 0 {
		return fmt.Errorf("%w: proxies is empty; give the proxy's base URL, e.g. http://proxy:8000", ErrInvalid)
	}
	for _, p := range c.Proxies {
		if _, err := HostPort(strings.TrimSuffix(p, "/")); err != nil {
			return fmt.Errorf("proxies: %w", err)
		}
	}
	for i := 0; i < len(c.Token); i++ {
		if c.Token[i] <= ' ' || c.Token[i] >= 0x7f {
			return fmt.Errorf("%w: token has whitespace or control characters; it must travel as one HTTP header value", ErrInvalid)
		}
	}
	if c.TTLS == 0 {
		c.TTLS = DefaultTTL.Seconds()
	}
	if err := c.Registration.Normalize(); err != nil {
		return err
	}
	if c.IntervalS == 0 {
		c.IntervalS = c.TTLS / 3
	}
	if c.IntervalS <= 0 || c.IntervalS >= c.TTLS {
		return fmt.Errorf("%w: interval_s = %g must be positive and below ttl_s = %g, or the entry lapses between heartbeats", ErrInvalid, c.IntervalS, c.TTLS)
	}
	return nil
}

// Registrar keeps one registration alive at every proxy.
type Registrar struct {
	cfg  RegistrarConfig
	body []byte
	log  *slog.Logger
	cli  *fasthttp.Client

	mu       sync.Mutex
	beats    uint64
	failures uint64
	lastErr  map[string]string // by proxy; empty string once it answers

	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// Start validates cfg, registers in the background at once, and keeps
// the heartbeat until Close.
func Start(cfg RegistrarConfig, log *slog.Logger) (*Registrar, error) {
	if err := cfg.Normalize(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	body, err := json.Marshal(cfg.Registration)
	if err != nil {
		return nil, fmt.Errorf("registrar: encode registration: %w", err)
	}
	r := &Registrar{
		cfg: cfg, body: body, log: log.With("role", "registrar", "url", cfg.URL),
		cli:     &fasthttp.Client{Name: "ecmooncake-registrar", MaxIdleConnDuration: time.Minute},
		lastErr: map[string]string{},
		stop:    make(chan struct{}), done: make(chan struct{}),
	}
	go r.loop()
	return r, nil
}

func (r *Registrar) interval() time.Duration {
	return time.Duration(r.cfg.IntervalS * float64(time.Second))
}

func (r *Registrar) loop() {
	defer close(r.done)
	t := time.NewTicker(r.interval())
	defer t.Stop()
	for {
		r.beat(RegisterPath)
		select {
		case <-r.stop:
			r.beat(DeregisterPath)
			return
		case <-t.C:
		}
	}
}

// beat sends one call to every proxy; a failure is logged when it starts
// and when it ends, not on every heartbeat.
func (r *Registrar) beat(path string) {
	defer func() {
		if p := recover(); p != nil {
			r.log.Error("registrar: recovered panic", "panic", p)
		}
	}()
	for _, proxy := range r.cfg.Proxies {
		err := r.post(strings.TrimSuffix(proxy, "/")+path, min(r.interval(), 5*time.Second))
		r.mu.Lock()
		prev, seen := r.lastErr[proxy]
		if err != nil {
			r.failures++
			r.lastErr[proxy] = err.Error()
			if path == DeregisterPath {
				r.log.Warn("could not deregister; the proxy drops the entry when its ttl lapses", "proxy", proxy, "cause", err)
			} else if !seen || prev == "" {
				r.log.Warn("cannot register with the proxy; retrying every interval", "proxy", proxy, "cause", err)
			}
		} else {
			r.beats++
			r.lastErr[proxy] = ""
			if !seen || prev != "" {
				r.log.Info("registered with the proxy", "proxy", proxy, "path", path)
			}
		}
		r.mu.Unlock()
	}
}

func (r *Registrar) post(url string, timeout time.Duration) error {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.Header.SetContentType("application/json")
	if r.cfg.Token != "" {
		req.Header.Set(fasthttp.HeaderAuthorization, "Bearer "+r.cfg.Token)
	}
	req.SetBody(r.body)
	if err := r.cli.DoTimeout(req, resp, timeout); err != nil {
		return fmt.Errorf("POST %s: %w", url, err)
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return fmt.Errorf("POST %s: status %d: %s", url, resp.StatusCode(), bytes.TrimSpace(resp.Body()))
	}
	return nil
}

// RegistrarStats are the registrar's counters.
type RegistrarStats struct {
	Beats    uint64            `json:"heartbeats"`
	Failures uint64            `json:"failures"`
	LastErr  map[string]string `json:"last_error"`
	URL      string            `json:"url"`
	Role     string            `json:"role"`
}

// Stats returns a snapshot.
func (r *Registrar) Stats() RegistrarStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	last := make(map[string]string, len(r.lastErr))
	for k, v := range r.lastErr {
		last[k] = v
	}
	return RegistrarStats{Beats: r.beats, Failures: r.failures, LastErr: last, URL: r.cfg.URL, Role: r.cfg.Role}
}

// Close deregisters (best effort, bounded by the call deadline) and stops.
func (r *Registrar) Close() error {
	r.once.Do(func() { close(r.stop) })
	t := time.NewTimer(r.interval() + 10*time.Second)
	defer t.Stop()
	select {
	case <-r.done:
		return nil
	case <-t.C:
		return fmt.Errorf("registrar %s: did not stop in time", r.cfg.URL)
	}
}
