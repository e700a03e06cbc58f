package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/atomic"
)

// upstream is the HTTP client of one backend: net/http's Transport, which
// ends a call (and closes its connection) when the call's context ends, so
// that vLLM aborts a request whose client went away, and which expires
// idle connections.
//
// A backend closes a connection idle for its keep-alive (vLLM: 5 s), and a
// request sent as that close is under way meets a dead connection. Two
// rules keep such a request from failing: idle connections expire before
// the backend's keep-alive (Config.UpstreamIdleTimeoutS), and a request
// that fails on a reused connection before any response byte is sent once
// more on a freshly dialed one, never on another pooled connection of the
// same age. Only that fresh connection's failure reaches the caller, so a
// stale connection never counts against the backend's health.
//
// Requests and responses are fasthttp's types, as on the server side;
// they are copied to and from net/http's at this edge.
type upstream struct {
	addr string
	// pooled keeps connections alive between calls; fresh dials one per
	// call and closes it after, for the retry of a stale connection.
	pooled, fresh *http.Transport
	// redialed counts a call sent again on a fresh connection.
	redialed func()
}

// maxIdle bounds idle connections kept per backend.
const maxIdle = 128

// upstreamConfig is what every backend's client of one proxy shares.
type upstreamConfig struct {
	idleTimeout time.Duration
	redialed    func(role string)
}

func newUpstream(addr, role string, cfg upstreamConfig) *upstream {
	d := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	transport := func(keepAlive bool) *http.Transport {
		return &http.Transport{
			// Never the environment's HTTP proxy: backends are reached
			// directly.
			Proxy:                  nil,
			DialContext:            d.DialContext,
			DisableKeepAlives:      !keepAlive,
			DisableCompression:     true,
			MaxIdleConns:           maxIdle,
			MaxIdleConnsPerHost:    maxIdle,
			IdleConnTimeout:        cfg.idleTimeout,
			MaxResponseHeaderBytes: 1 << 20,
			WriteBufferSize:        16 << 10,
			ReadBufferSize:         16 << 10,
		}
	}
	u := &upstream{addr: addr, pooled: transport(true), fresh: transport(false), redialed: func() {}}
	if cfg.redialed != nil {
		u.redialed = func() { cfg.redialed(role) }
	}
	return u
}

// close drops every idle connection; calls in flight finish on their own.
func (u *upstream) close() {
	u.pooled.CloseIdleConnections()
	u.fresh.CloseIdleConnections()
}

// exchange is a response whose body is still being read from the backend.
type exchange struct {
	resp *fasthttp.Response
	body io.ReadCloser
	// release returns the response object once nothing reads it.
	release func()
	closed  atomic.Bool
}

// Close releases the connection; a body not read to its end closes it.
func (x *exchange) Close() {
	if x.closed.Swap(true) {
		return
	}
	_ = x.body.Close()
	if x.release != nil {
		x.release()
	}
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

// errBodyTooLarge marks an answer above max_body_bytes.
var errBodyTooLarge = errors.New("response body too large")

// do sends req with body and reads the response head into resp. With stream false
// the body is read too (at most maxBody bytes) and the connection goes
// back to the pool; with stream true the caller reads exchange.body and
// must Close the exchange. The connection is closed as soon as ctx ends,
// whatever the call is doing.
func (u *upstream) do(ctx context.Context, req *fasthttp.Request, body outBody, resp *fasthttp.Response, stream bool, maxBody int) (*exchange, error) {
	hr, err := u.request(ctx, req, body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", u.addr, err)
	}
	var reused, answered atomic.Bool
	trace := &httptrace.ClientTrace{
		GotConn:              func(i httptrace.GotConnInfo) { reused.Store(i.Reused) },
		GotFirstResponseByte: func() { answered.Store(true) },
	}
	hresp, err := u.pooled.RoundTrip(hr.WithContext(httptrace.WithClientTrace(ctx, trace)))
	if err != nil && reused.Load() && !answered.Load() && ctx.Err() == nil {
		// The backend closed this connection while it sat idle, or as the
		// request went out; a connection of its age in the pool may be
		// just as dead, so the retry dials.
		u.redialed()
		if hr, err = u.request(ctx, req, body); err != nil {
			return nil, fmt.Errorf("%s: %w", u.addr, err)
		}
		hresp, err = u.fresh.RoundTrip(hr)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%s: %w", u.addr, context.Cause(ctx))
		}
		if !answered.Load() {
			return nil, fmt.Errorf("%s: %w: %w", u.addr, errNoResponse, err)
		}
		return nil, fmt.Errorf("%s: read response: %w", u.addr, err)
	}
	resp.SetStatusCode(hresp.StatusCode)
	if ct := hresp.Header.Get("Content-Type"); ct != "" {
		resp.Header.SetContentType(ct)
	}
	if stream {
		return &exchange{resp: resp, body: hresp.Body}, nil
	}
	defer hresp.Body.Close()
	got, err := io.ReadAll(io.LimitReader(hresp.Body, int64(maxBody)+1))
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%s: %w", u.addr, context.Cause(ctx))
		}
		return nil, fmt.Errorf("%s: read response: %w", u.addr, err)
	}
	if len(got) > maxBody {
		return nil, fmt.Errorf("%s: %w: more than %d bytes (max_body_bytes)", u.addr, errBodyTooLarge, maxBody)
	}
	resp.SetBodyRaw(got)
	return nil, nil
}

// request copies req's header into a net/http request to this backend;
// body goes out as its pieces, shared, not copied, and must outlive the
// call.
func (u *upstream) request(ctx context.Context, req *fasthttp.Request, body outBody) (*http.Request, error) {
	hr, err := http.NewRequestWithContext(ctx, string(req.Header.Method()), "http://"+u.addr+string(req.RequestURI()), http.NoBody)
	if err != nil {
		return nil, fmt.Errorf("build request: %w", err)
	}
	if n := body.len(); n > 0 {
		hr.Body, hr.ContentLength = io.NopCloser(body.reader()), int64(n)
	}
	for k, v := range req.Header.All() {
		switch string(k) {
		case fasthttp.HeaderHost, fasthttp.HeaderContentLength, fasthttp.HeaderConnection, fasthttp.HeaderTransferEncoding:
			continue
		}
		hr.Header.Add(string(k), string(v))
	}
	return hr, nil
}
