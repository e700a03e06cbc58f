package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// upstream is a keep-alive connection pool to one backend. It exists
// because fasthttp's client cannot abandon a call in flight: a client that
// disconnects must close the backend connection at once, so that vLLM
// aborts the request instead of generating for nobody. Each call closes
// its connection when its context ends.
type upstream struct {
	addr string
	dial func(ctx context.Context, addr string) (net.Conn, error)

	mu     sync.Mutex
	idle   []*upConn
	closed bool
}

// maxIdle bounds idle connections kept per backend.
const maxIdle = 128

type upConn struct {
	net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

func newUpstream(addr string) *upstream {
	d := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	return &upstream{addr: addr, dial: func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }}
}

func (u *upstream) get(ctx context.Context) (c *upConn, reused bool, err error) {
	u.mu.Lock()
	if n := len(u.idle); n > 0 {
		c = u.idle[n-1]
		u.idle = u.idle[:n-1]
		u.mu.Unlock()
		return c, true, nil
	}
	u.mu.Unlock()
	nc, err := u.dial(ctx, u.addr)
	if err != nil {
		return nil, false, fmt.Errorf("dial %s: %w", u.addr, err)
	}
	return &upConn{Conn: nc, br: bufio.NewReaderSize(nc, 16<<10), bw: bufio.NewWriterSize(nc, 16<<10)}, false, nil
}

func (u *upstream) put(c *upConn) {
	u.mu.Lock()
	if !u.closed && len(u.idle) < maxIdle {
		u.idle = append(u.idle, c)
		u.mu.Unlock()
		return
	}
	u.mu.Unlock()
	_ = c.Close()
}

// close drops every idle connection; calls in flight finish on their own.
func (u *upstream) close() {
	u.mu.Lock()
	idle := u.idle
	u.idle, u.closed = nil, true
	u.mu.Unlock()
	for _, c := range idle {
		_ = c.Close()
	}
}

// exchange is a response whose body is still being read from the backend.
type exchange struct {
	resp *fasthttp.Response
	body io.Reader
	c    *upConn
	stop func() bool
	// release returns the response object once nothing reads it.
	release func()
	once    sync.Once
}

// Close releases the connection; a streamed body is never reused, since
// its end cannot be told from the outside without reading it all.
func (x *exchange) Close() {
	x.once.Do(func() {
		x.stop()
		_ = x.c.Close()
		_ = x.resp.CloseBodyStream()
		if x.release != nil {
			x.release()
		}
	})
}

// newCall starts one call to a backend: ctx bounded by timeout, and a
// request with method and uri and an empty response from fasthttp's pools.
// done ends the context and returns both to the pools; the caller defers it.
func newCall(ctx context.Context, timeout time.Duration, method, uri string) (context.Context, *fasthttp.Request, *fasthttp.Response, func()) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	req.Header.SetMethod(method)
	req.SetRequestURI(uri)
	return ctx, req, resp, func() {
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
		cancel()
	}
}

// errNoResponse marks failures before any response byte: the backend
// never saw or never answered the request, so it is safe to send again.
var errNoResponse = errors.New("no response")

// do sends req and reads the response head. With stream false the body is
// read too and the connection goes back to the pool; with stream true the
// caller reads exchange.body and must Close the exchange. The connection
// is closed as soon as ctx ends, whatever the call is doing.
func (u *upstream) do(ctx context.Context, req *fasthttp.Request, resp *fasthttp.Response, stream bool, maxBody int) (*exchange, error) {
	req.Header.SetHost(u.addr)
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("%s: %w", u.addr, context.Cause(ctx))
		}
		c, reused, err := u.get(ctx)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", errNoResponse, err)
		}
		stop := context.AfterFunc(ctx, func() { _ = c.Close() })
		x, err := u.roundTrip(c, req, resp, stream, maxBody)
		if err == nil {
			if stream {
				x.stop = stop
				return x, nil
			}
			if stop() && !resp.ConnectionClose() {
				u.put(c)
			} else {
				_ = c.Close()
			}
			return nil, nil
		}
		stop()
		_ = c.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%s: %w", u.addr, context.Cause(ctx))
		}
		// A pooled connection the backend closed while idle fails before
		// any response byte; one fresh connection settles it.
		if reused && errors.Is(err, errNoResponse) && attempt == 0 {
			continue
		}
		return nil, fmt.Errorf("%s: %w", u.addr, err)
	}
}

func (u *upstream) roundTrip(c *upConn, req *fasthttp.Request, resp *fasthttp.Response, stream bool, maxBody int) (*exchange, error) {
	if err := req.Write(c.bw); err != nil {
		return nil, fmt.Errorf("%w: write request: %w", errNoResponse, err)
	}
	if err := c.bw.Flush(); err != nil {
		return nil, fmt.Errorf("%w: write request: %w", errNoResponse, err)
	}
	resp.StreamBody = stream
	if _, err := c.br.Peek(1); err != nil {
		return nil, fmt.Errorf("%w: read response: %w", errNoResponse, err)
	}
	if err := resp.ReadLimitBody(c.br, maxBody); err != nil {
		return nil, fmt.Errorf("read response: %w", err)
	}
	if !stream {
		return nil, nil
	}
	return &exchange{resp: resp, body: resp.BodyStream(), c: c}, nil
}
