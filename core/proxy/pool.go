package proxy

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/discovery"
)

// backend is one instance the proxy routes to.
type backend struct {
	reg    discovery.Registration
	addr   string
	up     *upstream
	static bool

	inflight atomic.Int64
	ranks    []atomic.Int64 // requests in flight per DP rank
	rankRR   atomic.Uint64

	mu      sync.Mutex
	healthy bool
	fails   int
	lastErr string
	expires time.Time // zero for static backends
	// The instance's vLLM version (GET /version), once asked: whether a
	// consumer takes embeddings-only requests (version.go).
	version      string
	versionKnown bool
}

func (p *pool) newBackend(reg discovery.Registration, static bool) (*backend, error) {
	addr, err := discovery.HostPort(reg.URL)
	if err != nil {
		return nil, err
	}
	return &backend{reg: reg, addr: addr, up: newUpstream(addr, p.role, p.up), static: static, healthy: true, ranks: make([]atomic.Int64, reg.DPSize)}, nil
}

func (b *backend) isHealthy() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.healthy
}

// BackendInfo describes a backend for GET /v1/ecm/backends and stats.
type BackendInfo struct {
	discovery.Registration
	Static   bool   `json:"static"`
	Healthy  bool   `json:"healthy"`
	Fails    int    `json:"consecutive_failures"`
	LastErr  string `json:"last_error,omitempty"`
	InFlight int64  `json:"in_flight"`
	ExpiresS int    `json:"expires_in_s,omitempty"`
}

func (b *backend) info(now time.Time) BackendInfo {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := BackendInfo{Registration: b.reg, Static: b.static, Healthy: b.healthy, Fails: b.fails, LastErr: b.lastErr, InFlight: b.inflight.Load()}
	if !b.expires.IsZero() {
		i.ExpiresS = int(b.expires.Sub(now).Seconds())
	}
	return i
}

// pool holds the backends of one role.
type pool struct {
	role      string
	threshold int
	up        upstreamConfig

	mu   sync.Mutex
	list []*backend
	rr   uint64
}

func (p *pool) snapshot() []*backend {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*backend(nil), p.list...)
}

// pick returns the healthy backend with the fewest requests in flight,
// skipping excluded ones; ties rotate so that an idle fleet shares work.
func (p *pool) pick(exclude map[*backend]bool) *backend {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.list)
	var best *backend
	p.rr++
	for i := 0; i < n; i++ {
		b := p.list[(int(p.rr)+i)%n]
		if exclude[b] || !b.isHealthy() {
			continue
		}
		if best == nil || b.inflight.Load() < best.inflight.Load() {
			best = b
		}
	}
	return best
}

// pickRank returns the DP rank of b with the fewest requests in flight;
// ties rotate.
func (b *backend) pickRank() int {
	n := len(b.ranks)
	start := int(b.rankRR.Add(1) % uint64(n))
	best := start
	for i := 1; i < n; i++ {
		r := (start + i) % n
		if b.ranks[r].Load() < b.ranks[best].Load() {
			best = r
		}
	}
	return best
}

// add inserts or refreshes a registration; a heartbeat from the instance
// itself proves it alive, so it is admitted at once.
func (p *pool) add(reg discovery.Registration, static bool, ttl time.Duration, now time.Time) (*backend, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, b := range p.list {
		if b.reg.URL != reg.URL {
			continue
		}
		if b.static && !static {
			// Not even a heartbeat: it would mark a failing static
			// backend healthy, and a new layout would redirect encoders
			// to another consumer endpoint.
			return nil, false, fmt.Errorf("%w: %s backend %s is listed on the proxy's command line; a registration cannot replace it", errStatic, p.role, reg.URL)
		}
		b.mu.Lock()
		same := b.reg.TPSize == reg.TPSize && b.reg.DPSize == reg.DPSize && b.reg.Consumer == reg.Consumer
		if same {
			b.reg.Host = reg.Host
			if !b.static {
				b.expires = now.Add(ttl)
			}
			b.healthy, b.fails, b.lastErr = true, 0, ""
			b.mu.Unlock()
			return b, false, nil
		}
		b.mu.Unlock()
		// The instance restarted with another layout: replace the entry
		// (requests in flight keep the old one until they finish).
		nb, err := p.newBackend(reg, b.static)
		if err != nil {
			return nil, false, err
		}
		if !static {
			nb.expires = now.Add(ttl)
		}
		p.list[i] = nb
		b.up.close()
		return nb, true, nil
	}
	nb, err := p.newBackend(reg, static)
	if err != nil {
		return nil, false, err
	}
	if !static {
		nb.expires = now.Add(ttl)
	}
	p.list = append(p.list, nb)
	sort.SliceStable(p.list, func(i, j int) bool { return p.list[i].reg.URL < p.list[j].reg.URL })
	return nb, true, nil
}

// remove drops a registered backend by URL; static ones stay, and static
// reports that the URL named one.
func (p *pool) remove(url string) (removed, static bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, b := range p.list {
		if b.reg.URL != url {
			continue
		}
		if b.static {
			return false, true
		}
		p.list = append(p.list[:i], p.list[i+1:]...)
		b.up.close()
		return true, false
	}
	return false, false
}

// expire drops registrations whose heartbeat lapsed.
func (p *pool) expire(now time.Time) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var gone []string
	kept := p.list[:0]
	for _, b := range p.list {
		b.mu.Lock()
		dead := !b.static && now.After(b.expires)
		b.mu.Unlock()
		if dead {
			gone = append(gone, b.reg.URL)
			b.up.close()
			continue
		}
		kept = append(kept, b)
	}
	clear(p.list[len(kept):])
	p.list = kept
	return gone
}

// report records the outcome of a call or health check, and says whether
// the backend's health changed.
func (p *pool) report(b *backend, err error) (changed, healthy bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	was := b.healthy
	if err == nil {
		b.healthy, b.fails, b.lastErr = true, 0, ""
	} else {
		b.fails++
		b.lastErr = err.Error()
		b.versionKnown = false
		if b.fails >= p.threshold {
			b.healthy = false
		}
	}
	return was != b.healthy, b.healthy
}

// checkHealth asks one backend's /health.
func checkHealth(ctx context.Context, b *backend, timeout time.Duration) error {
	ctx, req, resp, done := newCall(ctx, timeout, fasthttp.MethodGet, "/health")
	defer done()
	if _, err := b.up.do(ctx, req, nil, resp, false, 1<<20); err != nil {
		return fmt.Errorf("health check: %w", err)
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return fmt.Errorf("health check: status %d", resp.StatusCode())
	}
	return nil
}
