package proxy

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/ecmooncake/ecmooncake/core/discovery"
)

// maxDiscoveryBody bounds what fasthttp reads for a discovery call: a
// registration is a few hundred bytes, and the user port's body limit is
// sized for images.
const maxDiscoveryBody = 64 << 10

// TokenEnv is where the command line looks for the register token.
const TokenEnv = "ECMOONCAKE_REGISTER_TOKEN"

// errStatic marks a discovery call that would replace or remove a
// backend the operator listed.
var errStatic = errors.New("static backend")

// authResult is what a bearer-token check found.
type authResult int

const (
	// authOff: the proxy holds no token, so discovery is off.
	authOff authResult = iota
	// authMissing: no "Authorization: Bearer ..." header.
	authMissing
	// authBad: a bearer token that is not the proxy's.
	authBad
	// authOK: the proxy's token.
	authOK
)

func (a authResult) String() string {
	switch a {
	case authOff:
		return "off"
	case authMissing:
		return "unauthenticated"
	case authBad:
		return "bad_token"
	case authOK:
		return "ok"
	}
	return "unknown"
}

// adminAuth checks the register token. It keeps only a digest of the
// token: comparing digests of equal length in constant time tells a
// caller nothing about the token's length or any prefix of it.
type adminAuth struct {
	on   bool
	want [sha256.Size]byte
}

func newAdminAuth(token string) adminAuth {
	if token == "" {
		return adminAuth{}
	}
	return adminAuth{on: true, want: sha256.Sum256([]byte(token))}
}

var bearer = []byte("bearer ")

func (a adminAuth) check(header []byte) authResult {
	if !a.on {
		return authOff
	}
	if len(header) <= len(bearer) || !bytes.EqualFold(header[:len(bearer)], bearer) {
		return authMissing
	}
	got := sha256.Sum256(header[len(bearer):])
	if subtle.ConstantTimeCompare(got[:], a.want[:]) != 1 {
		return authBad
	}
	return authOK
}

// isDiscovery reports whether a request URI names a discovery endpoint.
func isDiscovery(uri []byte) bool { return bytes.HasPrefix(uri, []byte("/v1/ecm/")) }

// discoveryLimit caps the body of discovery calls before fasthttp reads it.
func discoveryLimit(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	if isDiscovery(h.RequestURI()) {
		return fasthttp.RequestConfig{MaxRequestBodySize: maxDiscoveryBody}
	}
	return fasthttp.RequestConfig{}
}

// readError answers a request fasthttp could not read (fasthttp's own
// answer is a bare 400 for a body over the limit too).
func (p *Proxy) readError(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge) && isDiscovery(ctx.Request.Header.RequestURI()):
		op := "register"
		if bytes.HasPrefix(ctx.Request.Header.RequestURI(), []byte(discovery.DeregisterPath)) {
			op = "deregister"
		}
		p.refuse(ctx, op, "too_large", fasthttp.StatusRequestEntityTooLarge, fmt.Sprintf("a discovery call's body is at most %d bytes", maxDiscoveryBody))
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, "BadRequestError", fmt.Sprintf("request body above the proxy's limit of %d bytes (max_body_bytes)", p.cfg.MaxBodyBytes))
	case errors.As(err, &small):
		writeError(ctx, fasthttp.StatusRequestHeaderFieldsTooLarge, "BadRequestError", "request header too large")
	default:
		writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", "cannot parse the request: "+err.Error())
	}
}

// handleAdmin serves the admin port: discovery only.
func (p *Proxy) handleAdmin(ctx *fasthttp.RequestCtx) {
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("proxy: recovered panic in the admin handler", "path", string(ctx.Path()), "panic", r)
			writeError(ctx, fasthttp.StatusInternalServerError, "InternalServerError", fmt.Sprintf("proxy internal error: %v", r))
		}
	}()
	if !p.serveDiscovery(ctx) {
		writeError(ctx, fasthttp.StatusNotFound, "NotFoundError", fmt.Sprintf("the admin port serves only %s, %s and %s, not %s %s",
			discovery.RegisterPath, discovery.DeregisterPath, discovery.BackendsPath, ctx.Method(), ctx.Path()))
	}
}

// serveDiscovery answers a discovery call and reports whether it was one.
func (p *Proxy) serveDiscovery(ctx *fasthttp.RequestCtx) bool {
	path := string(ctx.Path())
	switch {
	case ctx.IsPost() && path == discovery.RegisterPath:
		p.serveRegister(ctx)
	case ctx.IsPost() && path == discovery.DeregisterPath:
		p.serveDeregister(ctx)
	case path == discovery.BackendsPath:
		// The list names every consumer's control endpoint, so it is the
		// register token's to read, like registration itself.
		if p.authorizeToken(ctx, "list") {
			writeJSON(ctx, fasthttp.StatusOK, p.backends())
		}
	default:
		return false
	}
	return true
}

// authorize checks a register or deregister call's token; a refusal is
// answered, counted and logged here.
func (p *Proxy) authorize(ctx *fasthttp.RequestCtx, op string) bool {
	if !p.cfg.AllowRegister {
		p.refuse(ctx, op, "off", fasthttp.StatusForbidden, "registration is off on this proxy (allow_register is false): it routes to its static backends only")
		return false
	}
	return p.authorizeToken(ctx, op)
}

// authorizeToken checks the bearer token alone; a refusal is answered,
// counted and logged here.
func (p *Proxy) authorizeToken(ctx *fasthttp.RequestCtx, op string) bool {
	switch res := p.auth.check(ctx.Request.Header.Peek(fasthttp.HeaderAuthorization)); res {
	case authOK:
		return true
	case authOff:
		what := "registration"
		if op == "list" {
			what = "the backend list"
		}
		p.refuse(ctx, op, res.String(), fasthttp.StatusForbidden, what+" is off on this proxy: it has no register token. Start it with --register-token-file FILE or $"+TokenEnv+", and give the registering instances the same token")
	case authMissing:
		ctx.Response.Header.Set(fasthttp.HeaderWWWAuthenticate, "Bearer")
		p.refuse(ctx, op, res.String(), fasthttp.StatusUnauthorized, op+" needs the proxy's register token as a bearer token (Authorization: Bearer <token>)")
	default:
		ctx.Response.Header.Set(fasthttp.HeaderWWWAuthenticate, `Bearer error="invalid_token"`)
		p.refuse(ctx, op, res.String(), fasthttp.StatusUnauthorized, "the bearer token is not this proxy's register token")
	}
	return false
}

// refuse answers a refused discovery call, counts it and logs it (at most
// once per interval per reason, with the number left unlogged).
func (p *Proxy) refuse(ctx *fasthttp.RequestCtx, op, reason string, status int, msg string) {
	p.m.refusals.WithLabelValues(op, reason).Inc()
	if ok, suppressed := p.refused.Admit(op+"/"+reason, time.Now()); ok {
		p.log.Warn("discovery call refused", "op", op, "reason", reason, "status", status,
			"remote", ctx.RemoteAddr().String(), "detail", msg, "refusals_not_logged", suppressed)
	}
	writeError(ctx, status, errorTypeOf(status), msg)
}

func errorTypeOf(status int) string {
	switch status {
	case fasthttp.StatusUnauthorized:
		return "AuthenticationError"
	case fasthttp.StatusForbidden:
		return "PermissionDeniedError"
	case fasthttp.StatusConflict:
		return "ConflictError"
	case fasthttp.StatusRequestEntityTooLarge:
		return "RequestTooLargeError"
	}
	return "BadRequestError"
}

func (p *Proxy) serveRegister(ctx *fasthttp.RequestCtx) {
	const op = "register"
	if !p.authorize(ctx, op) {
		return
	}
	reg, err := discovery.Decode(ctx.PostBody())
	if err != nil {
		p.refuse(ctx, op, "invalid", fasthttp.StatusBadRequest, err.Error())
		return
	}
	ttl := reg.TTL()
	if ttl == 0 {
		ttl = p.cfg.defaultTTL()
	}
	_, added, err := p.poolOf(reg.Role).add(reg, false, ttl, time.Now())
	if errors.Is(err, errStatic) {
		p.refuse(ctx, op, "static", fasthttp.StatusConflict, err.Error())
		return
	}
	if err != nil {
		p.refuse(ctx, op, "invalid", fasthttp.StatusBadRequest, err.Error())
		return
	}
	kind := "heartbeat"
	if added {
		kind = "new"
		p.log.Info("instance registered", "backend_role", reg.Role, "url", reg.URL, "consumer", reg.Consumer,
			"tp_size", reg.TPSize, "dp_size", reg.DPSize, "host", reg.Host, "ttl", ttl, "remote", ctx.RemoteAddr().String())
	}
	p.m.registers.WithLabelValues(kind).Inc()
	writeJSON(ctx, fasthttp.StatusOK, map[string]any{"ok": true, "ttl_s": ttl.Seconds()})
}

// deregistration is the body of a deregister request.
type deregistration struct {
	Role string `json:"role"`
	URL  string `json:"url"`
}

func decodeDeregister(body []byte) (deregistration, error) {
	var in deregistration
	if err := json.Unmarshal(body, &in); err != nil || in.URL == "" {
		return deregistration{}, errors.New("deregister wants {\"role\": ..., \"url\": ...}")
	}
	return in, nil
}

func (p *Proxy) serveDeregister(ctx *fasthttp.RequestCtx) {
	const op = "deregister"
	if !p.authorize(ctx, op) {
		return
	}
	in, err := decodeDeregister(ctx.PostBody())
	if err != nil {
		p.refuse(ctx, op, "invalid", fasthttp.StatusBadRequest, err.Error())
		return
	}
	removed, static := false, false
	for _, pl := range p.pools() {
		if in.Role == "" || in.Role == pl.role {
			r, s := pl.remove(in.URL)
			removed, static = removed || r, static || s
		}
	}
	if static && !removed {
		p.refuse(ctx, op, "static", fasthttp.StatusConflict, fmt.Sprintf("%s: %s is a static backend (listed on the proxy's command line); only the operator removes it", errStatic, in.URL))
		return
	}
	if removed {
		p.m.registers.WithLabelValues("deregister").Inc()
		p.log.Info("instance deregistered", "backend_role", in.Role, "url", in.URL, "remote", ctx.RemoteAddr().String())
	}
	writeJSON(ctx, fasthttp.StatusOK, map[string]any{"ok": true, "removed": removed})
}
