package proxy

import (
	"bytes"
	"container/list"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

// Routing by where an image already is.
//
// A PD instance that served an image keeps its encoder output for a while:
// in its encoder cache, in its prefix cache (the image's KV blocks), and in
// the connector's slab, where a second push of the same item is answered
// "cached" without moving its bytes. Sent back to that PD, a repeated
// image costs neither a transfer nor, with its prefix cached, a prefill of
// its tokens; sent to another PD, it costs both. Least-loaded routing
// sends it wherever the load happens to be lowest.
//
// The proxy learns where each item went from what it already does: every
// request it routes names its items (a digest of each media part as it is
// sent, with the request fields that change the encoder's output) and the
// PD that served them. It keeps the latest PD per item in a bounded LRU
// (Config.AffinityEntries, with an age limit, Config.AffinityTTLS). It
// learns nothing of evictions, so an entry is a guess that the PD still
// holds the item: a wrong guess costs what least-loaded routing costs
// anyway (the PD receives or encodes the item again), never a wrong answer.
//
// An item the picked PD is known to hold, under the identifier an encoder
// gave it, is not encoded again (Config.AffinityReuse): the PD gets the
// client's media part with that identifier as its "uuid", which is the
// key vLLM would compute for it anyway. The PD finds the item in its
// encoder cache, or, when it was evicted there, encodes it itself, so a
// wrong guess costs one local encode and never a wrong answer. Reused
// items are counted (ecm_proxy_media_items_total{outcome="reused"}).
//
// An item an encoder encoded before, sent to a PD that is not known to
// hold it (its holder was over the slack, or is gone), is not encoded
// again either when Config.StoreReuse is on and the PD takes embeddings
// (vLLM >= 0.30): the PD gets the client's media part under the item's
// identifier, and its ec_items entry names a fresh transfer id and
// "source": "store", so that the PD's connector gets the item from
// Mooncake Store into its own slab (the encoder put it there). A PD that
// does not find it there encodes it itself from the media: a wrong guess
// costs one Store get and one local encode. Counted as
// ecm_proxy_media_items_total{outcome="store"}.
//
// A request goes to the healthy PD that served most of its items when that
// PD has at most Config.AffinitySlack more requests in flight than the
// least-loaded one; otherwise load wins. Each decision is counted
// (ecm_proxy_routing_total{reason}).

// itemKey names one media item as the encoder will see it.
type itemKey [sha256.Size]byte

// affinity is the bounded map from item to the PD that last served it.
type affinity struct {
	cap int
	ttl time.Duration

	mu      sync.Mutex
	order   *list.List // of *affinityEntry, most recent first
	byKey   map[itemKey]*list.Element
	evicted int64
}

type affinityEntry struct {
	key  itemKey
	url  string // the PD's base URL, as registered
	id   string // the item's identifier (mm_hash), when an encoder named it
	seen time.Time
}

func newAffinity(entries int, ttl time.Duration) *affinity {
	return &affinity{cap: entries, ttl: ttl, order: list.New(), byKey: map[itemKey]*list.Element{}}
}

// note records that url served the items; ids[i], when not empty, is item
// i's identifier.
func (a *affinity) note(url string, keys []itemKey, ids []string, now time.Time) {
	if a == nil || a.cap <= 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, k := range keys {
		id := ""
		if i < len(ids) {
			id = ids[i]
		}
		if el, ok := a.byKey[k]; ok {
			e := el.Value.(*affinityEntry)
			if e.url != url || id != "" {
				e.id = id
			}
			e.url, e.seen = url, now
			a.order.MoveToFront(el)
			continue
		}
		a.byKey[k] = a.order.PushFront(&affinityEntry{key: k, url: url, id: id, seen: now})
		for a.order.Len() > a.cap {
			last := a.order.Back()
			a.order.Remove(last)
			delete(a.byKey, last.Value.(*affinityEntry).key)
			a.evicted++
		}
	}
}

// holders counts, per PD URL, how many of the items it served within the
// age limit.
func (a *affinity) holders(keys []itemKey, now time.Time) map[string]int {
	if a == nil || a.cap <= 0 || len(keys) == 0 {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var out map[string]int
	for _, k := range keys {
		el, ok := a.byKey[k]
		if !ok {
			continue
		}
		e := el.Value.(*affinityEntry)
		if now.Sub(e.seen) > a.ttl {
			continue
		}
		if out == nil {
			out = map[string]int{}
		}
		out[e.url]++
	}
	return out
}

// heldAt returns the identifier of an item url served within the age
// limit, or "" when url is not known to hold it or its identifier is
// unknown.
func (a *affinity) heldAt(key itemKey, url string, now time.Time) string {
	return a.identifier(key, now, func(e *affinityEntry) bool { return e.url == url })
}

// encodedAs returns the identifier an encoder gave an item that some PD
// served within the age limit, or "" when none is known.
func (a *affinity) encodedAs(key itemKey, now time.Time) string {
	return a.identifier(key, now, func(*affinityEntry) bool { return true })
}

// identifier is the entry's identifier when the item is known, seen within
// the age limit and accepted by match; else "".
func (a *affinity) identifier(key itemKey, now time.Time, match func(*affinityEntry) bool) string {
	if a == nil || a.cap <= 0 {
		return ""
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	el, ok := a.byKey[key]
	if !ok {
		return ""
	}
	e := el.Value.(*affinityEntry)
	if !match(e) || now.Sub(e.seen) > a.ttl {
		return ""
	}
	return e.id
}

// size is the number of entries held, and the evictions so far.
func (a *affinity) size() (int, int64) {
	if a == nil {
		return 0, 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.order.Len(), a.evicted
}

// itemKeys names each distinct media item of a request: the request
// fields that change what the encoder computes, and the part as it goes
// out. A part with a client-chosen key is named by its tenant too, as its
// namespaced key would be (keys.go).
func (r *chatRequest) itemKeys() []itemKey {
	if len(r.items) == 0 {
		return nil
	}
	h := sha256.New()
	for _, k := range encoderKeys {
		if v, ok := r.top[k]; ok {
			h.Write([]byte(k))
			h.Write([]byte{0})
			h.Write([]byte(compactSum(v)))
		}
	}
	base := h.Sum(nil)
	keys := make([]itemKey, len(r.items))
	for i, p := range r.items {
		h := sha256.New()
		h.Write(base)
		if _, keyed := r.overrides[[2]int{r.first[i].msg, r.first[i].part}]; keyed {
			h.Write([]byte("tenant\x00" + r.tenant + "\x00"))
		}
		h.Write([]byte(compactSum(json.RawMessage(p))))
		copy(keys[i][:], h.Sum(nil))
	}
	return keys
}

// pickAffine picks the consumer for a request whose items are held as
// holders says: the healthy, not excluded, backend holding most of them
// while its load is within slack of the least loaded; else the least
// loaded. reason says which rule decided.
func (p *pool) pickAffine(exclude map[*backend]bool, holders map[string]int, slack int64) (*backend, string) {
	least := p.pick(exclude)
	if least == nil || len(holders) == 0 {
		return least, "least_loaded"
	}
	var best *backend
	bestN := 0
	for _, b := range p.snapshot() {
		n := holders[b.reg.URL]
		if n == 0 || exclude[b] || !b.isHealthy() {
			continue
		}
		if n > bestN || (n == bestN && b.inflight.Load() < best.inflight.Load()) {
			best, bestN = b, n
		}
	}
	if best == nil {
		return least, "least_loaded"
	}
	if best.inflight.Load() > least.inflight.Load()+slack {
		return least, "affinity_overloaded"
	}
	return best, "affinity"
}

// reuseAt sends each item with a reuse identifier as the client's media
// part under that identifier: its "uuid" member set to it (replaced where
// the part names one, added where it does not), from slices of the body.
func (r *chatRequest) reuseAt(reuse []string) error {
	keyOf := map[[2]int]json.RawMessage{}
	for _, k := range r.keyRefs {
		keyOf[[2]int{k.msg, k.part}] = k.key
	}
	for _, ref := range r.refs {
		id := reuse[ref.item]
		if id == "" {
			continue
		}
		value, _ := json.Marshal(id) // a string always encodes
		at := [2]int{ref.msg, ref.part}
		part := r.parts[ref.msg][ref.part]
		var out outBody
		if key, ok := keyOf[at]; ok {
			off, ok := subsliceOffset(part, key)
			if !ok {
				return fmt.Errorf("reuse of item %d: its key is not inside its part", ref.item)
			}
			out = outBody{part[:off], value, part[off+len(key):]}
		} else {
			end := bytes.LastIndexByte(part, '}')
			if end < 0 {
				return fmt.Errorf("reuse of item %d: its part is not an object", ref.item)
			}
			sep := []byte(",")
			if len(bytes.TrimSpace(part[1:end])) == 0 {
				sep = nil // an empty object
			}
			out = outBody{part[:end], append(append(sep, `"uuid":`...), value...), part[end:]}
		}
		if r.overrides == nil {
			r.overrides = map[[2]int]outBody{}
		}
		r.overrides[at] = out
	}
	return nil
}
