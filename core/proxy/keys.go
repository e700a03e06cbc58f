package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"unsafe"

	"github.com/valyala/fasthttp"
)

// Client-chosen cache keys.
//
// vLLM lets a client name a media part's cache key: a content part's
// "uuid" becomes the item's mm_hash, in place of a hash of its bytes.
// Everything that reuses an encoder output (the PD's encoder cache, its
// prefix cache, the transfer's dedup, a store shared by the fleet) looks
// items up by that key. A key a client chooses is therefore a name in a
// space every client shares: a second client that sends another image (or
// its own embeddings) under the first client's uuid is served the first
// client's embeddings, or plants its own for the first client to get.
//
// The proxy decides, per request, what becomes of such keys
// (Config.ClientMediaKeys):
//
//   - "namespace" (the default): the key is replaced by a digest of the
//     tenant and the key, so equal keys meet only within one tenant. The
//     tenant is the value of Config.TenantHeader when set (a gateway in
//     front of the proxy authenticates clients and names the tenant; the
//     proxy must then be reachable only through it), else a digest of the
//     request's Authorization header. A request that names a key but has
//     no tenant is refused: every anonymous client would share one space.
//   - "refuse": a request that names a key is refused (400).
//   - "trust": keys pass unchanged (one tenant, or clients that trust each
//     other).
//
// Content-addressed keys (no uuid) are left alone: equal bytes are the
// same image whoever sends them, which is the reuse the fleet wants.
//
// The rewrite keeps the proxy's one-copy rule (jsonspan.go): a part with a
// key goes out as the slices of the client's body before and after the
// key's value, with the new value between them.

// Client key policies.
const (
	KeysNamespace = "namespace"
	KeysRefuse    = "refuse"
	KeysTrust     = "trust"
)

// errClientKey is wrapped by every refusal of a client-chosen key; the
// handler answers it with 400.
var errClientKey = errors.New("client-chosen media key refused")

// keyRef places one content part that carries a client-chosen key.
type keyRef struct {
	msg, part int
	key       json.RawMessage // the uuid's value, a slice of the part
}

// applyKeys enforces the policy on the request's client-chosen keys. It
// returns how many keys were namespaced; tenant is the request's tenant,
// empty when it has none.
func (r *chatRequest) applyKeys(policy, tenant string) (int, error) {
	if len(r.keyRefs) == 0 || policy == KeysTrust {
		return 0, nil
	}
	if policy == KeysRefuse {
		return 0, fmt.Errorf("%w: this proxy does not accept a client-chosen \"uuid\" on a content part (client_media_keys=refuse); send the part without it", errClientKey)
	}
	if tenant == "" {
		return 0, fmt.Errorf("%w: a content part names a \"uuid\", and the request names no tenant (no Authorization header%s); keys are kept apart per tenant (client_media_keys=namespace)", errClientKey, r.tenantHint)
	}
	r.tenant = tenant
	for _, k := range r.keyRefs {
		var key string
		if err := json.Unmarshal(k.key, &key); err != nil {
			return 0, fmt.Errorf("%w: a content part's \"uuid\" is not a string", errClientKey)
		}
		part := r.parts[k.msg][k.part]
		off, ok := subsliceOffset(part, k.key)
		if !ok {
			// Unreachable for slices the span helpers returned; a wrong
			// offset would corrupt the request, so it is refused instead.
			return 0, fmt.Errorf("rewrite of a content part's \"uuid\": its value is not inside the part")
		}
		value, _ := json.Marshal(namespacedKey(tenant, key)) // a string always encodes
		if r.overrides == nil {
			r.overrides = map[[2]int]outBody{}
		}
		r.overrides[[2]int{k.msg, k.part}] = outBody{part[:off], value, part[off+len(k.key):]}
	}
	return len(r.keyRefs), nil
}

// namespacedKey is the key a tenant's client-chosen key becomes: two
// tenants never meet on it, and it names neither the tenant nor the key.
func namespacedKey(tenant, key string) string {
	h := sha256.New()
	h.Write([]byte("ecmooncake client media key\x00"))
	h.Write([]byte(tenant))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return "t-" + hex.EncodeToString(h.Sum(nil)[:20])
}

// tenantOf names a request's tenant: the tenant header's value when the
// proxy is configured with one, else a digest of the Authorization header
// (so the credential itself never becomes part of a key), else "".
func tenantOf(header string, get func(string) []byte, authorization []byte) string {
	if header != "" {
		if v := get(header); len(v) > 0 {
			return "h:" + string(v)
		}
		return ""
	}
	if len(authorization) == 0 {
		return ""
	}
	sum := sha256.Sum256(authorization)
	return "a:" + hex.EncodeToString(sum[:])
}

// partBody is the part at (msg, part) as it goes out: the client's bytes,
// or their rewrite with a namespaced key.
func (r *chatRequest) partBody(msg, part int) outBody {
	if o, ok := r.overrides[[2]int{msg, part}]; ok {
		return o
	}
	return outBody{r.parts[msg][part]}
}

// subsliceOffset is where sub, a slice of b's memory (objectMembers and
// arrayElems return such slices), starts within b.
func subsliceOffset(b, sub []byte) (int, bool) {
	off := int(uintptr(unsafe.Pointer(unsafe.SliceData(sub))) - uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	return off, off >= 0 && off+len(sub) <= len(b)
}

// clientKeys applies Config.ClientMediaKeys to a parsed request; false
// means the request was refused and answered.
func (p *Proxy) clientKeys(ctx *fasthttp.RequestCtx, c *call) bool {
	r := c.req
	if len(r.keyRefs) == 0 {
		return true
	}
	if p.cfg.ClientMediaKeys == KeysTrust {
		p.m.keys.WithLabelValues("trusted").Add(float64(len(r.keyRefs)))
		return true
	}
	if p.cfg.TenantHeader != "" {
		r.tenantHint = ", and no " + p.cfg.TenantHeader + " header"
	}
	tenant := tenantOf(p.cfg.TenantHeader, func(h string) []byte { return ctx.Request.Header.Peek(h) }, c.auth)
	n, err := r.applyKeys(p.cfg.ClientMediaKeys, tenant)
	if err != nil {
		p.m.keys.WithLabelValues("refused").Add(float64(len(r.keyRefs)))
		p.finish(c, fasthttp.StatusBadRequest)
		writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", err.Error())
		return false
	}
	p.m.keys.WithLabelValues("namespaced").Add(float64(n))
	return true
}
