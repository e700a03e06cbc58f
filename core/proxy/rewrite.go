package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// Content part types that carry media the encoder can serve, and the
// embeds part that replaces each modality on the consumer.
var (
	modalityOf = map[string]string{"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}
	embedsOf   = map[string]string{"image": "image_embeds", "audio": "audio_embeds", "video": "video_embeds"}
)

// encoderKeys are the request fields that change what the encoder
// computes (and so the identifier it reports); every other field is about
// generation, which the encoder does not do.
var encoderKeys = []string{"model", "mm_processor_kwargs", "media_io_kwargs", "chat_template_kwargs"}

// chatRequest is a parsed /v1/chat/completions body: only the parts the
// rewrite touches are decoded, the rest stays raw. Every raw value is a
// slice of raw, never a copy (see jsonspan.go).
type chatRequest struct {
	raw      []byte
	top      map[string]json.RawMessage
	messages []map[string]json.RawMessage
	parts    map[int][]json.RawMessage // content arrays, by message index
	refs     []mediaRef                // every media part, in prompt order
	items    []json.RawMessage         // distinct media parts
	kinds    []string                  // the modality of each distinct part, from its type
	first    []mediaRef                // where each distinct part first appears
	stream   bool
	// keyRefs are the content parts (of any type) that name a cache key
	// of the client's choosing; overrides their rewrite (keys.go).
	keyRefs    []keyRef
	overrides  map[[2]int]outBody
	tenant     string // set when keys were namespaced
	tenantHint string
}

// mediaRef places one media part in the prompt and names its distinct item.
type mediaRef struct{ msg, part, item int }

var errNotJSON = errors.New("request body is not a JSON object")

// parseRequest reads a chat or completions body. A body of a shape it does
// not know (no messages, content not a list) has no media as far as the
// proxy is concerned and goes to the consumer unchanged, which answers as
// vLLM would.
func parseRequest(body []byte, chat bool) (*chatRequest, error) {
	r := &chatRequest{raw: body}
	if !json.Valid(body) {
		return nil, errNotJSON
	}
	var ok bool
	if r.top, ok = objectMembers(body); !ok {
		return nil, errNotJSON
	}
	if s, ok := r.top["stream"]; ok {
		_ = json.Unmarshal(s, &r.stream)
	}
	msgs, ok := r.top["messages"]
	if !chat || !ok {
		return r, nil
	}
	raws, ok := arrayElems(msgs)
	if !ok {
		return r, nil
	}
	seen := map[string]int{}
	var decoded []map[string]json.RawMessage
	for mi, m := range raws {
		msg, ok := objectMembers(m)
		if !ok {
			return r, nil
		}
		decoded = append(decoded, msg)
		c, ok := msg["content"]
		if !ok {
			continue
		}
		parts, ok := arrayElems(c)
		if !ok {
			continue
		}
		for pi, p := range parts {
			if key, ok := clientKey(p); ok {
				if r.parts == nil {
					r.parts = map[int][]json.RawMessage{}
				}
				r.parts[mi] = parts
				r.keyRefs = append(r.keyRefs, keyRef{msg: mi, part: pi, key: key})
			}
			var head struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(p, &head) != nil || modalityOf[head.Type] == "" {
				continue
			}
			if r.parts == nil {
				r.parts = map[int][]json.RawMessage{}
			}
			r.parts[mi] = parts
			// Identical parts (the same image twice) are encoded once: the
			// bytes, uuid included, decide, compared by a digest rather
			// than by a compacted copy of each.
			key := compactSum(p)
			item, dup := seen[key]
			if !dup {
				item = len(r.items)
				seen[key] = item
				r.items = append(r.items, p)
				r.kinds = append(r.kinds, modalityOf[head.Type])
				r.first = append(r.first, mediaRef{msg: mi, part: pi, item: item})
			}
			r.refs = append(r.refs, mediaRef{msg: mi, part: pi, item: item})
		}
	}
	r.messages = decoded
	return r, nil
}

// clientKey returns the value of a content part's "uuid" when the part is
// an object that names one (null names none, as in vLLM).
func clientKey(part json.RawMessage) (json.RawMessage, bool) {
	// The common case, decided without splitting the part: a key written
	// with escapes ("\u0075uid") has a backslash.
	if !bytes.Contains(part, []byte("uuid")) && bytes.IndexByte(part, '\\') < 0 {
		return nil, false
	}
	m, ok := objectMembers(part)
	if !ok {
		return nil, false
	}
	v, ok := m["uuid"]
	if !ok || string(v) == "null" {
		return nil, false
	}
	return v, true
}

// hasMedia reports whether any part can go to an encoder.
func (r *chatRequest) hasMedia() bool { return len(r.items) > 0 }

// modality is the modality of distinct item i as its part's type says.
func (r *chatRequest) modality(item int) string { return r.kinds[item] }

// encoderBody is the request that sends one media item to an encoder,
// telling it which consumer to push to and under which transfer id. The
// item goes out as the slice of the client's body it is.
func (r *chatRequest) encoderBody(item int, consumer, transferID string) (outBody, error) {
	out := map[string]outBody{}
	for _, k := range encoderKeys {
		if v, ok := r.top[k]; ok {
			out[k] = outBody{v}
		}
	}
	var msgs jsonWriter
	msgs.lit(`[{"content":[`)
	msgs.body(r.partBody(r.first[item].msg, r.first[item].part))
	msgs.lit(`],"role":"user"}]`)
	out["messages"] = msgs.done()
	out["max_tokens"] = outBody{[]byte("1")}
	out["stream"] = outBody{[]byte("false")}
	params, err := json.Marshal(map[string]any{
		// Both spellings: ours, and the one vLLM's in-tree connector reads.
		"consumer":     consumer,
		"consumer_zmq": consumer,
		"ec_items":     []any{map[string]string{"transfer_id": transferID}},
	})
	if err != nil {
		return nil, fmt.Errorf("encode ec_transfer_params: %w", err)
	}
	out["ec_transfer_params"] = outBody{params}
	return marshalTop(out), nil
}

// encoded is what an encoder reported for one item.
// sourceStore marks an ec_items entry whose item the consumer gets from
// Mooncake Store (the connector's request.SOURCE_STORE).
const sourceStore = "store"

type encoded struct {
	identifier string
	modality   string
	metadata   json.RawMessage
	entry      json.RawMessage // the encoder's whole per-item entry
	transferID string
	// store: no encoder pushes this item; the consumer gets it from
	// Mooncake Store itself, and gets the client's media under identifier
	// to encode it with when the Store does not hold it.
	store bool
	// derived names the fields the encoder left out and the proxy filled
	// in from what it sent (vLLM 0.32 reports no modality).
	derived []string
}

// parseEncoderReply finds the item pushed under transferID in an encoder's
// response: the entry naming that transfer id, or the only entry when the
// encoder does not echo ids. sent is the modality of the part the proxy
// sent; it stands in for an entry that names none.
func parseEncoderReply(body []byte, transferID, sent string) (*encoded, error) {
	var reply struct {
		Params map[string]json.RawMessage `json:"ec_transfer_params"`
	}
	if err := json.Unmarshal(body, &reply); err != nil {
		return nil, fmt.Errorf("encoder reply is not JSON: %w", err)
	}
	if len(reply.Params) == 0 {
		return nil, errors.New("encoder reply has no ec_transfer_params (is it an EC producer?)")
	}
	var found []*encoded
	for id, raw := range reply.Params {
		var e struct {
			Modality   string          `json:"modality"`
			Metadata   json.RawMessage `json:"metadata"`
			TransferID string          `json:"transfer_id"`
		}
		if json.Unmarshal(raw, &e) != nil || id == "" {
			continue
		}
		it := &encoded{identifier: id, modality: e.Modality, metadata: e.Metadata, entry: raw, transferID: e.TransferID}
		if e.TransferID == transferID {
			found = []*encoded{it}
			break
		}
		if e.TransferID == "" {
			found = append(found, it)
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("encoder reply names %d items, none of them transfer %s", len(reply.Params), transferID)
	}
	it := found[0]
	if it.modality == "" && sent != "" {
		it.modality = sent
		it.derived = append(it.derived, "modality")
	}
	if _, ok := embedsOf[it.modality]; !ok {
		return nil, fmt.Errorf("encoder reports modality %q for %s; want image, audio or video", it.modality, it.identifier)
	}
	if len(bytes.TrimSpace(it.metadata)) == 0 || string(bytes.TrimSpace(it.metadata)) == "null" {
		it.metadata = json.RawMessage(`{}`)
	}
	it.transferID = transferID
	return it, nil
}

// consumerTop returns the top-level fields of the consumer's request:
// with embeds, every media part that was encoded becomes an embeds
// reference to the pushed item (without, for a consumer of vLLM < 0.30,
// the media stays: see version.go), and ec_transfer_params lists the
// items to wait for. done[i] is nil where item i falls back to its
// original media. The second result is false when nothing was encoded,
// and the body can go unchanged.
func (r *chatRequest) consumerTop(done []*encoded, embeds bool) (map[string]outBody, bool, error) {
	top := rawTop(r.top)
	some := false
	for _, d := range done {
		some = some || d != nil
	}
	if !some && len(r.overrides) == 0 {
		return top, false, nil
	}
	parts := make(map[int][]json.RawMessage, len(r.parts))
	for mi, ps := range r.parts {
		parts[mi] = append([]json.RawMessage(nil), ps...)
	}
	replaced := map[[2]int]bool{}
	type ecItem struct {
		MMHash     string `json:"mm_hash"`
		TransferID string `json:"transfer_id"`
		Source     string `json:"source,omitempty"`
	}
	params := map[string]any{}
	var items []ecItem
	for _, ref := range r.refs {
		d := done[ref.item]
		if d == nil {
			continue
		}
		if d.store {
			// The media stays (reuseAt set its uuid): the consumer encodes
			// from it when the Store does not hold the item.
			items = append(items, ecItem{MMHash: d.identifier, TransferID: d.transferID, Source: sourceStore})
			continue
		}
		if embeds {
			typ := embedsOf[d.modality]
			part, err := json.Marshal(map[string]any{"type": typ, typ: d.metadata, "uuid": d.identifier})
			if err != nil {
				return nil, false, fmt.Errorf("encode %s part: %w", typ, err)
			}
			parts[ref.msg][ref.part] = part
			replaced[[2]int{ref.msg, ref.part}] = true
		}
		items = append(items, ecItem{MMHash: d.identifier, TransferID: d.transferID})
		// vLLM's in-tree connector reads the encoder's per-item entries
		// from the same dict; ours reads ec_items.
		params[d.identifier] = d.entry
	}
	params["ec_items"] = items
	// Messages and parts that stay as they were go out as the slices of
	// the client's body they are.
	var msgs jsonWriter
	msgs.lit("[")
	for mi, m := range r.messages {
		if mi > 0 {
			msgs.lit(",")
		}
		ps, ok := parts[mi]
		if !ok {
			msgs.object(rawTop(m))
			continue
		}
		var content jsonWriter
		content.lit("[")
		for pi, part := range ps {
			if pi > 0 {
				content.lit(",")
			}
			if replaced[[2]int{mi, pi}] {
				content.raw(part)
			} else {
				content.body(r.partBody(mi, pi))
			}
		}
		content.lit("]")
		msg := rawTop(m)
		msg["content"] = content.done()
		msgs.object(msg)
	}
	msgs.lit("]")
	top["messages"] = msgs.done()
	if !some {
		// Only keys were rewritten: nothing to wait for.
		return top, true, nil
	}
	ps, err := json.Marshal(params)
	if err != nil {
		return nil, false, err
	}
	top["ec_transfer_params"] = outBody{ps}
	return top, true, nil
}

// prefillTop turns a consumer request into the prefill half of a split
// prefill/decode pair: one token, no stream, and a request for the KV
// transfer parameters the decode instance needs (vLLM's P/D protocol).
func prefillTop(top map[string]outBody) map[string]outBody {
	out := make(map[string]outBody, len(top)+2)
	for k, v := range top {
		out[k] = v
	}
	delete(out, "stream_options")
	delete(out, "max_completion_tokens")
	out["stream"] = outBody{[]byte(`false`)}
	out["max_tokens"] = outBody{[]byte(`1`)}
	out["kv_transfer_params"] = outBody{[]byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)}
	return out
}

// decodeTop is the decode half: the consumer request without the EC
// parameters (the decode instance receives KV, not encoder outputs) and
// with the prefill's kv_transfer_params.
// prefillKV is what a prefill instance's answer hands on to the decode
// instance: its kv_transfer_params, or nothing when the answer has none
// or is not a JSON object.
func prefillKV(body []byte) json.RawMessage {
	var kv struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(body, &kv)
	return kv.KV
}

func decodeTop(top map[string]outBody, kv json.RawMessage) map[string]outBody {
	out := make(map[string]outBody, len(top))
	for k, v := range top {
		out[k] = v
	}
	delete(out, "ec_transfer_params")
	// What the prefill answered goes on as it came, so it must be JSON.
	if len(kv) > 0 && json.Valid(kv) {
		out["kv_transfer_params"] = outBody{kv}
	}
	return out
}

// marshalTop writes a request's top-level members, keys in order, as the
// pieces they are; every value is valid JSON already.
func marshalTop(top map[string]outBody) outBody {
	var w jsonWriter
	w.object(top)
	return w.done()
}
