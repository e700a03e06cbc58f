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
// Bytes are granted as they arrive (a header's Content-Length costs
// nothing until the body is sent), so holding a share costs an attacker
// the bytes themselves, and for no longer than the server's read timeout.
type bodyBudget struct {
	limit int64

	mu     sync.Mutex
	inUse  int64
	high   int64
	refuse uint64
}

func newBodyBudget(limit int64) *bodyBudget { return &bodyBudget{limit: limit} }

// bodyGrant is one request's share. Not safe for concurrent use; release
// is idempotent.
type bodyGrant struct {
	b      *bodyBudget
	held   int64
	passed bool // the request's goroutine handed release to another
}

func (b *bodyBudget) open() *bodyGrant { return &bodyGrant{b: b} }

// grow adds n bytes to the grant, or reports false (and counts a
// refusal) if that would take the budget over its limit.
func (g *bodyGrant) grow(n int64) bool {
	b := g.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inUse+n > b.limit {
		b.refuse++
		return false
	}
	b.inUse += n
	g.held += n
	b.high = max(b.high, b.inUse)
	return true
}

// shrinkTo gives back what the grant holds beyond n bytes.
func (g *bodyGrant) shrinkTo(n int64) {
	if n >= g.held {
		return
	}
	g.b.mu.Lock()
	g.b.inUse -= g.held - n
	g.b.mu.Unlock()
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

var errOverBudget = errors.New("over the proxy's budget of body bytes in flight")

// bodyChunk is the first allocation for a body of unknown length and the
// least growth step; the buffer doubles from there, each step granted
// before it is allocated.
const bodyChunk = 64 << 10

// takeBody reads the request's body under g into memory, or answers the
// request itself and reports false: 503 and Retry-After over the budget
// (once the rest of the body is read and dropped), 413 over the request's
// limit (which a streamed body is not held to by the server). The
// connection is closed on any error.
func (p *Proxy) takeBody(ctx *fasthttp.RequestCtx, g *bodyGrant) bool {
	stream := ctx.RequestBodyStream()
	if stream == nil {
		return true
	}
	max := p.cfg.MaxBodyBytes
	if isDiscovery(ctx.Request.Header.RequestURI()) {
		max = maxDiscoveryBody
	}
	body, err := readBody(stream, ctx.Request.Header.ContentLength(), max, g)
	if err == nil {
		ctx.Request.SetBodyRaw(body)
		return true
	}
	ctx.SetConnectionClose()
	switch {
	case errors.Is(err, errOverBudget):
		// Read the rest into nothing (a pooled 8 KiB buffer, no grant)
		// before answering: a client still sending when the proxy closes
		// with unread bytes gets a reset, not the 503. The read timeout
		// and the limit bound what this costs.
		if _, derr := io.Copy(io.Discard, io.LimitReader(stream, int64(max)+1)); derr != nil {
			return false
		}
		ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError",
			fmt.Sprintf("the proxy holds its most request-body bytes at once (max_body_bytes %d × max_bodies_in_flight %d); retry shortly",
				p.cfg.MaxBodyBytes, p.cfg.MaxBodiesInFlight))
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		p.readError(ctx, err)
	default:
		writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", "cannot read the request body: "+err.Error())
	}
	return false
}

// readBody reads a body of at most max bytes from r (of the announced
// length, or -1 when chunked) into a buffer whose every byte of capacity
// g granted first.
func readBody(r io.Reader, length int, max int, g *bodyGrant) ([]byte, error) {
	if length > max {
		return nil, fasthttp.ErrBodyTooLarge
	}
	want := bodyChunk
	if length >= 0 {
		want = min(length, bodyChunk)
	}
	if !g.grow(int64(want)) {
		return nil, errOverBudget
	}
	buf := make([]byte, 0, want)
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
			next := min(2*cap(buf), max+1)
			if length >= 0 {
				next = min(next, length)
			}
			if !g.grow(int64(next - cap(buf))) {
				return nil, errOverBudget
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
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
