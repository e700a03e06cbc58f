package proxy

import (
	"crypto/sha256"
	"encoding/json"
	"io"
	"net"
	"slices"
	"unicode/utf8"
)

// The proxy holds one copy of a request's body, the one its budget
// granted: it splits the body into the values it rewrites without
// copying them (the helpers below return sub-slices of a body that
// json.Valid accepted), and each request it sends on is an outBody,
// pieces of the client's body and the few bytes the proxy adds, written
// one after the other and never joined. So an image of N bytes costs N
// bytes of memory once, however many calls it goes out on.

// skipSpace returns the index of the first byte at or after i that is not
// JSON whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the index just past the JSON value that starts at
// b[i], which must be valid JSON.
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				i = skipString(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
		return len(b)
	default: // number, true, false, null
		for i < len(b) && !(b[i] == ',' || b[i] == '}' || b[i] == ']' || b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
			i++
		}
		return i
	}
}

// skipString returns the index just past the string that starts at b[i].
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// objectMembers splits a valid JSON value into its members when it is an
// object; the values share b's memory. A repeated key keeps its last
// value, as encoding/json does.
func objectMembers(b []byte) (map[string]json.RawMessage, bool) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	m := map[string]json.RawMessage{}
	for i = skipSpace(b, i+1); i < len(b) && b[i] != '}'; {
		ke := skipString(b, i)
		key := string(b[i+1 : ke-1])
		// Escapes and bytes that are not UTF-8 are decoded as encoding/json
		// decodes them (invalid bytes become U+FFFD).
		if slices.Contains(b[i:ke], '\\') || !utf8.Valid(b[i:ke]) {
			if json.Unmarshal(b[i:ke], &key) != nil {
				return nil, false
			}
		}
		vs := skipSpace(b, skipSpace(b, ke)+1) // past the colon
		ve := skipValue(b, vs)
		m[key] = b[vs:ve:ve]
		if i = skipSpace(b, ve); i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return m, true
}

// arrayElems splits a valid JSON value into its elements when it is an
// array; the elements share b's memory.
func arrayElems(b []byte) ([]json.RawMessage, bool) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '[' {
		return nil, false
	}
	var out []json.RawMessage
	for i = skipSpace(b, i+1); i < len(b) && b[i] != ']'; {
		e := skipValue(b, i)
		out = append(out, b[i:e:e])
		if i = skipSpace(b, e); i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return out, true
}

// compactSum is a digest of a valid JSON value with the whitespace between
// its tokens left out: two values that json.Compact makes equal have the
// same sum, without a compacted copy of either.
func compactSum(b []byte) string {
	h := sha256.New()
	start, in := 0, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case in && c == '\\':
			i++
		case c == '"':
			in = !in
		case !in && (c == ' ' || c == '\t' || c == '\n' || c == '\r'):
			h.Write(b[start:i])
			start = i + 1
		}
	}
	h.Write(b[start:])
	return string(h.Sum(nil))
}

// outBody is a request body as the pieces it is written from.
type outBody [][]byte

func (o outBody) len() int {
	n := 0
	for _, p := range o {
		n += len(p)
	}
	return n
}

// reader reads the pieces in order; each call starts from the first.
func (o outBody) reader() io.Reader {
	bufs := net.Buffers(slices.Clone(o))
	return &bufs
}

// bytes joins the pieces (tests, and the fuzz targets).
func (o outBody) bytes() []byte {
	out := make([]byte, 0, o.len())
	for _, p := range o {
		out = append(out, p...)
	}
	return out
}

// jsonWriter builds an outBody: the proxy's own bytes go into small
// pieces of their own, the client's values in as they are.
type jsonWriter struct {
	out outBody
	own []byte
}

func (w *jsonWriter) lit(s string) { w.own = append(w.own, s...) }

// raw adds a valid JSON value without copying it.
func (w *jsonWriter) raw(v []byte) {
	if len(v) < 256 {
		w.own = append(w.own, v...)
		return
	}
	w.flush()
	w.out = append(w.out, v)
}

// body adds a value already built as pieces.
func (w *jsonWriter) body(v outBody) {
	for _, p := range v {
		w.raw(p)
	}
}

func (w *jsonWriter) key(k string) {
	b, _ := json.Marshal(k) // a string always encodes
	w.own = append(w.own, b...)
	w.own = append(w.own, ':')
}

func (w *jsonWriter) flush() {
	if len(w.own) > 0 {
		w.out = append(w.out, w.own)
		w.own = nil
	}
}

func (w *jsonWriter) done() outBody {
	w.flush()
	return w.out
}

// object writes the members of m, keys in order, as an object.
func (w *jsonWriter) object(m map[string]outBody) {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	w.lit("{")
	for i, k := range keys {
		if i > 0 {
			w.lit(",")
		}
		w.key(k)
		w.body(m[k])
	}
	w.lit("}")
}

// rawTop is m's values as bodies of one piece each.
func rawTop(m map[string]json.RawMessage) map[string]outBody {
	out := make(map[string]outBody, len(m))
	for k, v := range m {
		out[k] = outBody{v}
	}
	return out
}
