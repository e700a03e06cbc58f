package proxy

import (
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/valyala/fasthttp"
)

// bodyBudget bounds the request-body bytes the proxy holds across all
// requests in flight, where max_body_bytes bounds only each one: without
// it N concurrent bodies at the limit grow the proxy by N × the limit.
// Each client (peer address) holds at most perClient of it, so that one
// client's stalled uploads cannot hold the whole budget.
//
// A body is the one copy of its bytes the proxy keeps: it is read into
// a buffer of the announced length, granted before it is allocated, and
// every request the proxy sends on is cut from it without a copy
// (jsonspan.go). A body without a length grows by doubling, each step
// granted with the buffer it replaces still counted until the copy is
// done. So the budget counts what the proxy's memory holds for bodies.
type bodyBudget struct {
	limit, perClient int64

	mu      sync.Mutex
	inUse   int64
	high    int64
	clients map[string]int64 // held, by client
	refuse  uint64           // over the budget
	share   uint64           // over a client's share
}

func newBodyBudget(limit, perClient int64) *bodyBudget {
	return &bodyBudget{limit: limit, perClient: perClient, clients: map[string]int64{}}
}

// bodyGrant is one request's share. Not safe for concurrent use; release
// is idempotent.
type bodyGrant struct {
	b      *bodyBudget
	client string
	held   int64
	passed bool // the request's goroutine handed release to another
}

func (b *bodyBudget) open(client string) *bodyGrant { return &bodyGrant{b: b, client: client} }

// grow adds n bytes to the grant, or reports which limit it would pass:
// errOverBudget or errOverShare (each counted).
func (g *bodyGrant) grow(n int64) error {
	b := g.b
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.inUse+n > b.limit:
		b.refuse++
		return errOverBudget
	case b.clients[g.client]+n > b.perClient:
		b.share++
		return errOverShare
	}
	b.inUse += n
	b.clients[g.client] += n
	g.held += n
	b.high = max(b.high, b.inUse)
	return nil
}

// shrinkTo gives back what the grant holds beyond n bytes.
func (g *bodyGrant) shrinkTo(n int64) {
	if n >= g.held {
		return
	}
	b := g.b
	b.mu.Lock()
	b.inUse -= g.held - n
	if b.clients[g.client] -= g.held - n; b.clients[g.client] <= 0 {
		delete(b.clients, g.client)
	}
	b.mu.Unlock()
	g.held = n
}

func (g *bodyGrant) release() { g.shrinkTo(0) }

// pass hands the grant to whoever outlives the handler (a streamed
// answer's writer, which holds the request until its last byte), and
// returns its release.
func (g *bodyGrant) pass() func() {
	g.passed = true
	return g.release
}

func (b *bodyBudget) held() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.inUse
}

func (b *bodyBudget) peak() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.high
}

func (b *bodyBudget) refused() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.refuse
}

func (b *bodyBudget) refusedShare() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.share
}

var (
	errOverBudget = errors.New("over the proxy's budget of body bytes in flight")
	errOverShare  = errors.New("over this client's share of the budget of body bytes in flight")
)

// bodyChunk is the first allocation for a body of unknown length and the
// least growth step; the buffer doubles from there, each step granted
// before it is allocated.
const bodyChunk = 64 << 10

// takeBody reads the request's body under g into memory it owns, and
// returns it, or answers the request itself and reports false: 503 and
// Retry-After over the budget or the client's share (once the rest of the
// body is read and dropped), 413 over the request's limit (which a
// streamed body is not held to by the server). The connection is closed
// on any error.
func (p *Proxy) takeBody(ctx *fasthttp.RequestCtx, g *bodyGrant) ([]byte, bool) {
	stream := ctx.RequestBodyStream()
	if stream == nil {
		// fasthttp read a small body into its own buffer, which it reuses
		// once the handler returns: a streamed answer outlives that, so
		// the body is copied, under the grant.
		small := ctx.PostBody()
		if len(small) == 0 {
			return nil, true
		}
		if g.grow(int64(len(small))) != nil {
			ctx.SetConnectionClose()
			p.overBudget(ctx)
			return nil, false
		}
		body := append([]byte(nil), small...)
		ctx.Request.SetBodyRaw(body)
		return body, true
	}
	max := p.cfg.MaxBodyBytes
	if isDiscovery(ctx.Request.Header.RequestURI()) {
		max = maxDiscoveryBody
	}
	body, err := readBody(stream, ctx.Request.Header.ContentLength(), max, g)
	if err == nil {
		ctx.Request.SetBodyRaw(body)
		return body, true
	}
	ctx.SetConnectionClose()
	switch {
	case errors.Is(err, errOverBudget), errors.Is(err, errOverShare):
		// Read the rest into nothing (a pooled 8 KiB buffer, no grant)
		// before answering: a client still sending when the proxy closes
		// with unread bytes gets a reset, not the 503. The read timeout
		// and the limit bound what this costs.
		if _, derr := io.Copy(io.Discard, io.LimitReader(stream, int64(max)+1)); derr != nil {
			return nil, false
		}
		if errors.Is(err, errOverShare) {
			ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
			writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError",
				fmt.Sprintf("this client holds its share of the proxy's request-body bytes at once (max_body_bytes_per_client %d); retry once its other requests are in",
					p.cfg.maxBodyBytesPerClient()))
			return nil, false
		}
		p.overBudget(ctx)
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		p.readError(ctx, err)
	default:
		writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", "cannot read the request body: "+err.Error())
	}
	return nil, false
}

func (p *Proxy) overBudget(ctx *fasthttp.RequestCtx) {
	ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
	writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError",
		fmt.Sprintf("the proxy holds its most request-body bytes at once (max_body_bytes %d × max_bodies_in_flight %d); retry shortly",
			p.cfg.MaxBodyBytes, p.cfg.MaxBodiesInFlight))
}

// readBody reads a body of at most max bytes from r (of the announced
// length, or -1 when chunked) into a buffer whose every byte of capacity
// g granted first. A body of known length is read into one buffer of that
// length: growing one by doubling would leave each smaller buffer to the
// garbage collector, memory the budget would not see.
func readBody(r io.Reader, length int, max int, g *bodyGrant) ([]byte, error) {
	if length > max {
		return nil, fasthttp.ErrBodyTooLarge
	}
	if length >= 0 {
		if err := g.grow(int64(length)); err != nil {
			return nil, err
		}
		buf := make([]byte, length)
		if n, err := io.ReadFull(r, buf); err != nil {
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("body ended after %d of %d bytes: %w", n, length, io.ErrUnexpectedEOF)
			}
			return nil, err
		}
		return buf, nil
	}
	if err := g.grow(bodyChunk); err != nil {
		return nil, err
	}
	buf := make([]byte, 0, bodyChunk)
	for {
		if len(buf) == cap(buf) {
			if len(buf) > max || (length >= 0 && len(buf) >= length) {
				// A known length is enforced by the server; one more byte
				// than max tells a chunked body over the limit.
				if len(buf) > max {
					return nil, fasthttp.ErrBodyTooLarge
				}
				return buf, nil
			}
			// The old buffer stays counted until the new one holds its
			// bytes: both are memory until then.
			next := min(2*cap(buf), max+1)
			if err := g.grow(int64(next)); err != nil {
				return nil, err
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
			g.shrinkTo(g.held - int64(cap(buf)))
			buf = grown
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) {
			if length >= 0 && len(buf) < length {
				return nil, fmt.Errorf("body ended after %d of %d bytes: %w", len(buf), length, io.ErrUnexpectedEOF)
			}
			if len(buf) > max {
				return nil, fasthttp.ErrBodyTooLarge
			}
			g.shrinkTo(int64(cap(buf)))
			return buf, nil
		}
		if err != nil {
			return nil, err
		}
	}
}
