package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// Headers vLLM reads.
const (
	headerRequestID = "X-Request-Id"
	headerDPRank    = "X-data-parallel-rank"
)

func (p *Proxy) handle(ctx *fasthttp.RequestCtx) {
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("proxy: recovered panic in handler", "path", string(ctx.Path()), "panic", r)
			writeError(ctx, fasthttp.StatusInternalServerError, "InternalServerError", fmt.Sprintf("proxy internal error: %v", r))
		}
	}()
	g := p.bodies.open(ctx.RemoteIP().String())
	defer func() {
		if !g.passed {
			g.release()
		}
	}()
	body, ok := p.takeBody(ctx, g)
	if !ok {
		return
	}
	path := string(ctx.Path())
	post := ctx.IsPost()
	switch {
	case post && path == "/v1/chat/completions":
		p.serveGenerate(ctx, "chat", true, body, g)
	case post && path == "/v1/completions":
		p.serveGenerate(ctx, "completions", false, body, g)
	case path == "/health":
		p.serveHealth(ctx)
	case path == "/metrics":
		metrics.Write(ctx, p.m.gatherer)
	case p.cfg.AdminPort == 0 && p.serveDiscovery(ctx):
	case ctx.IsGet() && path == "/v1/models":
		p.serveModels(ctx)
	default:
		writeError(ctx, fasthttp.StatusNotFound, "NotFoundError", fmt.Sprintf("the proxy does not serve %s %s", ctx.Method(), path))
	}
}

func writeJSON(ctx *fasthttp.RequestCtx, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = fasthttp.StatusInternalServerError, []byte(`{"error":{"message":"encode reply failed"}}`)
	}
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// writeError answers in vLLM's error shape, so clients parse one format.
func writeError(ctx *fasthttp.RequestCtx, status int, typ, msg string) {
	writeJSON(ctx, status, map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}})
}

func (p *Proxy) serveHealth(ctx *fasthttp.RequestCtx) {
	for _, b := range p.consumers().snapshot() {
		if b.isHealthy() {
			writeJSON(ctx, fasthttp.StatusOK, map[string]string{"status": "ok"})
			return
		}
	}
	writeJSON(ctx, fasthttp.StatusServiceUnavailable, map[string]string{"status": "no healthy consumer instance"})
}

// serveModels asks one answering instance for its model list.
func (p *Proxy) serveModels(ctx *fasthttp.RequestCtx) {
	pl := p.consumers()
	if p.split() {
		pl = p.dec
	}
	b := pl.pick(nil)
	if b == nil {
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", "no healthy instance to ask")
		return
	}
	rctx, req, resp, done := newCall(context.Background(), p.cfg.encodeTimeout(), fasthttp.MethodGet, "/v1/models")
	defer done()
	copyAuth(ctx, req)
	if _, err := b.up.do(rctx, req, nil, resp, false, p.cfg.MaxBodyBytes); err != nil {
		p.noteHealth(pl, b, err)
		writeError(ctx, fasthttp.StatusBadGateway, "BadGatewayError", err.Error())
		return
	}
	ctx.SetStatusCode(resp.StatusCode())
	ctx.Response.Header.SetContentTypeBytes(resp.Header.ContentType())
	ctx.SetBody(resp.Body())
}

func copyAuth(ctx *fasthttp.RequestCtx, req *fasthttp.Request) {
	if a := ctx.Request.Header.Peek(fasthttp.HeaderAuthorization); len(a) > 0 {
		req.Header.SetBytesV(fasthttp.HeaderAuthorization, a)
	}
}

// call is one request's journey; it lives until the last byte is written.
type call struct {
	p      *Proxy
	route  string
	path   string
	id     string
	req    *chatRequest
	auth   []byte
	start  time.Time
	ctx    context.Context
	cancel context.CancelFunc
	gone   atomic.Bool
	// keys name the request's distinct media items (affinity.go); ids are
	// their identifiers as the last attempt learned or reused them.
	keys []itemKey
	ids  []string
}

// answer is what goes back to the client: a whole body, or a stream whose
// first events were read (and held) before the proxy committed to it.
type answer struct {
	status  int
	ctype   []byte
	body    []byte
	x       *exchange
	events  *sseReader
	held    [][]byte
	release func()
	// after runs with release: the decode instance's in-flight count.
	after   func()
	pdStart time.Time
}

// serveGenerate answers a generate call; body is the request's body, the
// proxy's one copy of it, and g its share of the budget, which goes to the
// stream writer when the answer is streamed.
func (p *Proxy) serveGenerate(ctx *fasthttp.RequestCtx, route string, chat bool, body []byte, g *bodyGrant) {
	c := &call{p: p, route: route, path: string(ctx.Path()), id: p.newID(), start: time.Now()}
	r, err := parseRequest(body, chat)
	if err != nil {
		p.finish(c, fasthttp.StatusBadRequest)
		writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	c.req = r
	if a := ctx.Request.Header.Peek(fasthttp.HeaderAuthorization); len(a) > 0 {
		c.auth = append([]byte(nil), a...)
	}
	if !p.clientKeys(ctx, c) {
		return
	}
	c.ctx, c.cancel = context.WithTimeout(context.Background(), p.cfg.requestTimeout())
	stopWatch := watchPeer(ctx.Conn(), func() {
		c.gone.Store(true)
		c.cancel()
	})
	ans, status, err := c.run()
	if err != nil {
		stopWatch()
		c.cancel()
		if c.gone.Load() {
			p.m.gone.Inc()
			p.log.Info("client went away; backend calls cancelled", "request_id", c.id)
		}
		p.finish(c, status)
		writeError(ctx, status, errorType(status), err.Error())
		return
	}
	ctx.SetStatusCode(ans.status)
	if len(ans.ctype) > 0 {
		ctx.Response.Header.SetContentTypeBytes(ans.ctype)
	}
	ctx.Response.Header.Set(headerRequestID, c.id)
	if ans.x == nil {
		stopWatch()
		c.cancel()
		ans.release()
		ctx.SetBody(ans.body)
		p.m.phase.WithLabelValues("pd").Observe(time.Since(ans.pdStart).Seconds())
		p.finish(c, ans.status)
		return
	}
	ctx.Response.Header.Set("Cache-Control", "no-cache")
	releaseBody := g.pass()
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
		defer p.recover("stream")
		defer func() {
			releaseBody()
			stopWatch()
			c.cancel()
			ans.x.Close()
			ans.release()
			p.m.phase.WithLabelValues("pd").Observe(time.Since(ans.pdStart).Seconds())
		}()
		if err := c.stream(w, ans); err != nil {
			if c.gone.Load() || errors.Is(err, errClientWrite) {
				p.m.gone.Inc()
				p.finish(c, 499)
				p.log.Info("client went away during the stream; backend call cancelled", "request_id", c.id, "cause", err)
				return
			}
			p.log.Warn("consumer stream broke after the first byte; the client sees a cut answer", "request_id", c.id, "cause", err)
			p.finish(c, fasthttp.StatusBadGateway)
			return
		}
		p.finish(c, ans.status)
	})
}

var errClientWrite = errors.New("write to client")

// stream writes the held events, then copies the rest as it comes,
// flushing after each event so tokens reach the client one by one.
func (c *call) stream(w *bufio.Writer, ans *answer) error {
	done := false
	for _, ev := range ans.held {
		if _, err := w.Write(ev); err != nil {
			return fmt.Errorf("%w: %w", errClientWrite, err)
		}
		done = done || isDoneEvent(ev)
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("%w: %w", errClientWrite, err)
	}
	for !done {
		ev, err := ans.events.next()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("read consumer stream: %w", err)
		}
		if _, err := w.Write(ev); err != nil {
			return fmt.Errorf("%w: %w", errClientWrite, err)
		}
		if err := w.Flush(); err != nil {
			return fmt.Errorf("%w: %w", errClientWrite, err)
		}
		done = isDoneEvent(ev)
	}
	// The client has the whole answer once [DONE] is through: what the
	// consumer does after it (end the chunked body, or not yet) is not the
	// client's, and a client that leaves now has been answered.
	return nil
}

// isDoneEvent reports whether an SSE event is OpenAI's end of stream.
func isDoneEvent(ev []byte) bool {
	return bytes.Equal(bytes.TrimSpace(ev), []byte("data: [DONE]"))
}

func errorType(status int) string {
	switch {
	case status == fasthttp.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case status == fasthttp.StatusGatewayTimeout:
		return "TimeoutError"
	case status >= 500:
		return "BadGatewayError"
	default:
		return "BadRequestError"
	}
}

// finish counts one answered request.
func (p *Proxy) finish(c *call, status int) {
	p.served.Add(1)
	outcome := "ok"
	switch {
	case status == 499:
		outcome = "cancelled"
	case status >= 500:
		outcome = "upstream_error"
	case status >= 400:
		outcome = "client_error"
	}
	p.m.requests.WithLabelValues(c.route, outcome).Inc()
	p.m.latency.WithLabelValues(c.route).Observe(time.Since(c.start).Seconds())
}

// errRetry marks a consumer failure before the first byte that another
// attempt may fix.
type errRetry struct {
	reason string
	err    error
}

func (e *errRetry) Error() string { return e.err.Error() }
func (e *errRetry) Unwrap() error { return e.err }

// run makes up to 1+Retries attempts. Each attempt picks a consumer (and
// DP rank), encodes every media item for it under fresh transfer ids, and
// sends the rewritten request. The status returned with an error is what
// the client gets.
func (c *call) run() (*answer, int, error) {
	p := c.p
	exclude := map[*backend]bool{}
	var last error
	keys := c.req.itemKeys()
	c.keys = keys
	for attempt := 0; attempt <= p.cfg.Retries; attempt++ {
		if attempt > 0 {
			p.m.retries.WithLabelValues(retryReason(last)).Inc()
			p.log.Info("retrying with fresh transfer ids", "request_id", c.id, "attempt", attempt, "cause", last)
		}
		pl := p.consumers()
		cons, reason := pl.pickAffine(exclude, p.aff.holders(keys, time.Now()), int64(p.cfg.AffinitySlack))
		if cons == nil && len(exclude) > 0 {
			// Every consumer failed once: try them again rather than give up.
			clear(exclude)
			cons, reason = pl.pick(nil), "least_loaded"
		}
		if cons == nil {
			return nil, fasthttp.StatusServiceUnavailable, fmt.Errorf("no healthy %s instance (see %s)", pl.role, discovery.BackendsPath)
		}
		if len(keys) > 0 {
			p.m.routing.WithLabelValues(reason).Inc()
		}
		ans, err := c.attempt(pl, cons, attempt, attempt == p.cfg.Retries)
		if err == nil {
			p.aff.note(cons.reg.URL, keys, c.ids, time.Now())
			return ans, 0, nil
		}
		if c.gone.Load() {
			return nil, 499, errors.New("client disconnected")
		}
		var rt *errRetry
		if !errors.As(err, &rt) {
			return nil, fasthttp.StatusBadGateway, err
		}
		exclude[cons] = true
		last = err
	}
	if errors.Is(last, context.DeadlineExceeded) {
		return nil, fasthttp.StatusGatewayTimeout, fmt.Errorf("request timed out after %s: %w", p.cfg.requestTimeout(), last)
	}
	return nil, fasthttp.StatusBadGateway, fmt.Errorf("consumer failed %d times: %w", p.cfg.Retries+1, last)
}

func retryReason(err error) string {
	var rt *errRetry
	if errors.As(err, &rt) {
		return rt.reason
	}
	return "other"
}

// attempt runs one try against one consumer. On the last try a consumer's
// own error answer goes to the client as it is, as vLLM would send it.
func (c *call) attempt(pl *pool, cons *backend, attempt int, last bool) (*answer, error) {
	p := c.p
	rank := cons.pickRank()
	cons.inflight.Add(1)
	cons.ranks[rank].Add(1)
	var once sync.Once
	release := func() {
		once.Do(func() {
			cons.inflight.Add(-1)
			cons.ranks[rank].Add(-1)
		})
	}
	top := rawTop(c.req.top)
	rewritten := false
	var err error
	if !c.req.hasMedia() && len(c.req.overrides) > 0 {
		// No media to encode, but client keys to namespace (embeds parts).
		if top, rewritten, err = c.req.consumerTop(nil, true); err != nil {
			release()
			return nil, err
		}
	}
	if c.req.hasMedia() {
		endpoint, err := discovery.RankEndpoint(cons.reg.Consumer, cons.reg.TPSize, rank)
		if err != nil {
			release()
			return nil, err
		}
		t0 := time.Now()
		reuse := c.reusable(cons)
		embeds := p.consumerTakesEmbeds(c.ctx, cons)
		done := c.encodeAll(endpoint, attempt, reuse, c.fromStore(cons, reuse, embeds))
		p.m.phase.WithLabelValues("encode").Observe(time.Since(t0).Seconds())
		if err := c.ctx.Err(); err != nil {
			release()
			return nil, fmt.Errorf("while encoding: %w", context.Cause(c.ctx))
		}
		c.ids = make([]string, len(done))
		for i, d := range done {
			if d != nil {
				c.ids[i] = d.identifier
			} else {
				c.ids[i] = reuse[i]
			}
		}
		// Items from the Store, and on vLLM < 0.30 (version.go) every
		// encoded item, go as the client's media too, under the identifier
		// the encoder reported, so that the consumer names them as the
		// encoder did (and can encode them itself).
		at := append([]string(nil), reuse...)
		for i, d := range done {
			if d != nil && (d.store || !embeds) {
				at[i] = d.identifier
			}
		}
		if err := c.req.reuseAt(at); err != nil {
			release()
			return nil, err
		}
		if top, rewritten, err = c.req.consumerTop(done, embeds); err != nil {
			release()
			return nil, err
		}
	}
	var ans *answer
	if p.split() {
		ans, err = c.splitCall(pl, cons, rank, top, last)
	} else {
		body := outBody{c.req.raw}
		if rewritten {
			body = marshalTop(top)
		}
		ans, err = c.send(pl, cons, rank, body, c.req.stream, last)
	}
	if err != nil {
		release()
		return nil, err
	}
	ans.release = func() {
		release()
		if ans.after != nil {
			ans.after()
		}
	}
	return ans, nil
}

// splitCall prefills on the consumer (which waits for the pushed items),
// then decodes on a decode instance with the prefill's KV parameters.
func (c *call) splitCall(pl *pool, cons *backend, rank int, top map[string]outBody, last bool) (*answer, error) {
	p := c.p
	pre, err := c.send(pl, cons, rank, marshalTop(prefillTop(top)), false, false)
	if err != nil {
		if !last {
			return nil, err
		}
		var rt *errRetry
		if !errors.As(err, &rt) {
			return nil, err
		}
		return nil, fmt.Errorf("prefill: %w", err)
	}
	if pre.status != fasthttp.StatusOK {
		return pre, nil // a client error from the prefill: the client sees it
	}
	kv := prefillKV(pre.body)
	dec := p.dec.pick(nil)
	if dec == nil {
		return nil, &errRetry{reason: "no_decode", err: errors.New("no healthy decode instance")}
	}
	dec.inflight.Add(1)
	ans, err := c.sendTo(p.dec, dec, -1, marshalTop(decodeTop(top, kv)), c.req.stream, last)
	if err != nil {
		dec.inflight.Add(-1)
		return nil, err
	}
	ans.after = func() { dec.inflight.Add(-1) }
	return ans, nil
}

func (c *call) send(pl *pool, b *backend, rank int, body outBody, stream, last bool) (*answer, error) {
	if b.reg.DPSize <= 1 {
		rank = -1
	}
	return c.sendTo(pl, b, rank, body, stream, last)
}

// sendTo posts body to one instance. A streamed answer is read up to its
// first event that carries output; what came before is held, so that a
// failure there can still be retried.
func (c *call) sendTo(pl *pool, b *backend, rank int, body outBody, stream, last bool) (*answer, error) {
	p := c.p
	req := fasthttp.AcquireRequest()
	defer fasthttp.ReleaseRequest(req)
	req.Header.SetMethod(fasthttp.MethodPost)
	req.SetRequestURI(c.path)
	req.Header.SetContentType("application/json")
	req.Header.Set(headerRequestID, c.id)
	if rank >= 0 {
		req.Header.Set(headerDPRank, strconv.Itoa(rank))
	}
	if len(c.auth) > 0 {
		req.Header.SetBytesV(fasthttp.HeaderAuthorization, c.auth)
	}
	resp := fasthttp.AcquireResponse()
	start := time.Now()
	x, err := b.up.do(c.ctx, req, body, resp, stream, p.cfg.MaxBodyBytes)
	if err != nil {
		fasthttp.ReleaseResponse(resp)
		if c.ctx.Err() != nil {
			return nil, fmt.Errorf("%s %s: %w", pl.role, b.reg.URL, err)
		}
		p.noteHealth(pl, b, err)
		return nil, &errRetry{reason: "unreachable", err: fmt.Errorf("%s %s: %w", pl.role, b.reg.URL, err)}
	}
	ans := &answer{status: resp.StatusCode(), ctype: append([]byte(nil), resp.Header.ContentType()...), pdStart: start}
	if x == nil || resp.StatusCode() != fasthttp.StatusOK {
		if x != nil {
			// A streamed request answered with an error status: vLLM sends
			// those as plain JSON. Read it whole (bounded) to decide.
			data, rerr := readAllLimited(x.body, 1<<20)
			x.Close()
			if rerr != nil {
				fasthttp.ReleaseResponse(resp)
				return nil, &errRetry{reason: "broken_stream", err: fmt.Errorf("%s %s: %w", pl.role, b.reg.URL, rerr)}
			}
			ans.body = data
		} else {
			ans.body = append([]byte(nil), resp.Body()...)
		}
		fasthttp.ReleaseResponse(resp)
		p.m.phase.WithLabelValues("transfer_wait").Observe(time.Since(start).Seconds())
		if retryableStatus(ans.status) && !last {
			return nil, &errRetry{reason: "status_" + strconv.Itoa(ans.status), err: fmt.Errorf("%s %s answered %d: %s", pl.role, b.reg.URL, ans.status, firstLine(ans.body))}
		}
		if ans.status < 500 {
			pl.report(b, nil)
		}
		return ans, nil
	}
	ans.x, ans.events = x, newSSEReader(x.body)
	for {
		ev, err := ans.events.next()
		if err != nil {
			x.Close()
			fasthttp.ReleaseResponse(resp)
			if errors.Is(err, io.EOF) && len(ans.held) > 0 {
				// The stream ended without output; let the client see it.
				return &answer{status: ans.status, ctype: ans.ctype, body: joinEvents(ans.held), pdStart: start}, nil
			}
			return nil, &errRetry{reason: "broken_stream", err: fmt.Errorf("%s %s: stream ended before any output: %w", pl.role, b.reg.URL, err)}
		}
		kind, msg := classify(ev)
		if kind == eventRetry && !last {
			x.Close()
			fasthttp.ReleaseResponse(resp)
			return nil, &errRetry{reason: "stream_error", err: fmt.Errorf("%s %s failed before the first token: %s", pl.role, b.reg.URL, msg)}
		}
		ans.held = append(ans.held, ev)
		if kind != eventHold {
			break
		}
	}
	p.m.phase.WithLabelValues("transfer_wait").Observe(time.Since(start).Seconds())
	pl.report(b, nil)
	// The response object backs the stream: it is released with the
	// exchange, never here.
	x.release = func() { fasthttp.ReleaseResponse(resp) }
	return ans, nil
}

func readAllLimited(r io.Reader, n int64) ([]byte, error) {
	return io.ReadAll(io.LimitReader(r, n))
}

func joinEvents(evs [][]byte) []byte {
	var out []byte
	for _, e := range evs {
		out = append(out, e...)
	}
	return out
}

func firstLine(b []byte) string {
	const max = 200
	s := string(b)
	for i, r := range s {
		if r == '\n' || i >= max {
			return s[:i]
		}
	}
	return s
}

// reusable returns, per distinct item, the identifier under which cons
// holds it (affinity.go), or "" where it must be encoded.
func (c *call) reusable(cons *backend) []string {
	reuse := make([]string, len(c.req.items))
	if !c.p.cfg.AffinityReuse {
		return reuse
	}
	now := time.Now()
	for i, k := range c.keys {
		reuse[i] = c.p.aff.heldAt(k, cons.reg.URL, now)
	}
	return reuse
}

// fromStore returns, per distinct item, the item as cons gets it from
// Mooncake Store itself (Config.StoreReuse, affinity.go), or nil: one an
// encoder encoded before (the affinity table knows its identifier) that
// cons is not known to hold, when cons takes embeddings (vLLM >= 0.30,
// whose connector gets items from the Store).
func (c *call) fromStore(cons *backend, reuse []string, embeds bool) []*encoded {
	out := make([]*encoded, len(c.req.items))
	if !c.p.cfg.StoreReuse || !embeds {
		return out
	}
	now := time.Now()
	for i, k := range c.keys {
		if reuse[i] != "" {
			continue
		}
		if id := c.p.aff.encodedAs(k, now); id != "" {
			out[i] = &encoded{identifier: id, modality: c.req.modality(i), transferID: newTransferID(), store: true}
		}
	}
	return out
}

// encodeAll sends every distinct media item to an encoder, concurrently.
// done[i] is nil where item i could not be encoded; that item falls back
// to its original media, which the consumer encodes itself.
// An item with a reuse identifier is not encoded: the consumer holds it;
// nor is one from the Store (store[i]): done[i] is store[i].
func (c *call) encodeAll(consumer string, attempt int, reuse []string, store []*encoded) []*encoded {
	p := c.p
	n := len(c.req.items)
	done := make([]*encoded, n)
	p.m.items.WithLabelValues("duplicate").Add(float64(len(c.req.refs) - n))
	var wg sync.WaitGroup
	for i := range n {
		if reuse[i] != "" {
			p.m.items.WithLabelValues("reused").Inc()
			continue
		}
		if store[i] != nil {
			p.m.items.WithLabelValues("store").Inc()
			p.log.Debug("media item from Mooncake Store", "request_id", c.id, "attempt", attempt, "item", i, "transfer_id", store[i].transferID)
			done[i] = store[i]
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer p.recover("encode")
			tid := newTransferID()
			p.log.Debug("transfer id minted", "request_id", c.id, "attempt", attempt, "item", i, "transfer_id", tid)
			e, err := c.encodeOne(i, consumer, tid)
			if err != nil {
				p.m.items.WithLabelValues("fallback").Inc()
				p.log.Warn("media item falls back to the consumer's own encoder", "request_id", c.id, "item", i, "transfer_id", tid, "cause", err)
				return
			}
			p.m.items.WithLabelValues("encoded").Inc()
			done[i] = e
		}()
	}
	wg.Wait()
	return done
}

// encodeOne tries the least-loaded encoder, and one more when the first
// cannot be reached.
func (c *call) encodeOne(item int, consumer, tid string) (*encoded, error) {
	p := c.p
	body, err := c.req.encoderBody(item, consumer, tid)
	if err != nil {
		return nil, err
	}
	tried := map[*backend]bool{}
	var last error = errors.New("no healthy encoder")
	for range 2 {
		enc := p.enc.pick(tried)
		if enc == nil {
			break
		}
		tried[enc] = true
		e, retry, err := c.encodeAt(enc, item, body, tid)
		if err == nil {
			p.m.encodes.WithLabelValues("ok").Inc()
			return e, nil
		}
		last = err
		if !retry {
			break
		}
	}
	p.m.encodes.WithLabelValues("failed").Inc()
	return nil, last
}

func (c *call) encodeAt(enc *backend, item int, body outBody, tid string) (*encoded, bool, error) {
	p := c.p
	enc.inflight.Add(1)
	defer enc.inflight.Add(-1)
	ctx, req, resp, done := newCall(c.ctx, p.cfg.encodeTimeout(), fasthttp.MethodPost, "/v1/chat/completions")
	defer done()
	req.Header.SetContentType("application/json")
	req.Header.Set(headerRequestID, fmt.Sprintf("%s-enc%d", c.id, item))
	if len(c.auth) > 0 {
		req.Header.SetBytesV(fasthttp.HeaderAuthorization, c.auth)
	}
	if _, err := enc.up.do(ctx, req, body, resp, false, p.cfg.MaxBodyBytes); err != nil {
		if c.ctx.Err() != nil {
			return nil, false, err
		}
		p.noteHealth(p.enc, enc, err)
		return nil, true, fmt.Errorf("encoder %s: %w", enc.reg.URL, err)
	}
	if resp.StatusCode() != fasthttp.StatusOK {
		return nil, false, fmt.Errorf("encoder %s answered %d: %s", enc.reg.URL, resp.StatusCode(), firstLine(resp.Body()))
	}
	p.enc.report(enc, nil)
	e, err := parseEncoderReply(resp.Body(), tid, c.req.modality(item))
	if err != nil {
		return nil, false, fmt.Errorf("encoder %s: %w", enc.reg.URL, err)
	}
	for _, field := range e.derived {
		p.m.derived.WithLabelValues(field).Inc()
		p.warnOnce("derived:"+field+":"+enc.reg.URL, "encoder answer lacks a field; the proxy fills it in from the request (vLLM before 0.33 leaves modality out)",
			"encoder", enc.reg.URL, "field", field, "value", e.modality, "identifier", e.identifier)
	}
	return e, false, nil
}
