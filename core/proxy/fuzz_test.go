package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/discovery"
)

// Bytes from the network that the proxy decodes, beyond the client's
// request (FuzzRewrite) and the encoder's reply (FuzzEncoderReply): a
// consumer's event stream, a prefill's answer, and the bodies of
// registration and deregistration.

// FuzzSSE splits a consumer's stream into events and classifies each the
// way the retry decision does. No event is blank or longer than the
// stream, nothing is invented, and CRLF line ends mean what LF ones do.
func FuzzSSE(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"error\":{\"message\":\"no encoder output\",\"code\":503}}\n\n"))
	f.Add([]byte(": keep-alive\n\n\n\ndata: {\"choices\":[],\"usage\":{\"total_tokens\":3}}"))
	f.Add([]byte("data: {\"error\":{\"type\":\"ServiceUnavailableError\",\"code\":\"503\"}}\r\n\r\n"))
	f.Fuzz(func(t *testing.T, stream []byte) {
		r := newSSEReader(bytes.NewReader(stream))
		total := 0
		for {
			ev, err := r.next()
			if err != nil {
				if !errors.Is(err, io.EOF) && !errors.Is(err, errEventTooLarge) {
					t.Fatalf("next: %v", err)
				}
				break
			}
			if len(bytes.TrimSpace(ev)) == 0 {
				t.Fatalf("a blank event %q", ev)
			}
			if total += len(ev); total > len(stream) {
				t.Fatalf("events of %d bytes from a %d-byte stream", total, len(stream))
			}
			kind, msg := classify(ev)
			if kind != eventHold && kind != eventCommit && kind != eventRetry {
				t.Fatalf("classify(%q) = kind %d", ev, kind)
			}
			if kind != eventRetry && msg != "" {
				t.Fatalf("classify(%q) = %d with a message %q", ev, kind, msg)
			}
			crlf := bytes.ReplaceAll(ev, []byte("\n"), []byte("\r\n"))
			if k2, m2 := classify(crlf); k2 != kind || m2 != msg {
				t.Fatalf("classify(%q) = %d %q, with CRLF %d %q", ev, kind, msg, k2, m2)
			}
		}
	})
}

// FuzzPrefillReply hands a prefill's answer on to the decode instance: the
// request that goes out is JSON whatever the answer held.
func FuzzPrefillReply(f *testing.F) {
	f.Add([]byte(`{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}}`))
	f.Add([]byte(`{"kv_transfer_params":null}`))
	f.Add([]byte(`[1]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		top := map[string]outBody{"model": {[]byte(`"m"`)}, "ec_transfer_params": {[]byte(`{}`)}}
		kv := prefillKV(body)
		out := marshalTop(decodeTop(top, kv)).bytes()
		var back map[string]json.RawMessage
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("decode request %q is not a JSON object: %v", out, err)
		}
		if _, ok := back["ec_transfer_params"]; ok {
			t.Fatalf("decode request %q keeps ec_transfer_params", out)
		}
	})
}

// FuzzRegistration admits what a registration body asks for into a pool:
// an accepted registration names a backend the proxy can dial.
func FuzzRegistration(f *testing.F) {
	f.Add([]byte(`{"role":"pd","url":"http://h:8100","consumer":"tcp://h:14579","tp_size":2,"dp_size":2,"ttl_s":30}`))
	f.Add([]byte(`{"role":"encode","url":"http://10.0.0.1"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		reg, err := discovery.Decode(body)
		if err != nil {
			return
		}
		pl := &pool{role: reg.Role, threshold: 3}
		b, _, err := pl.add(reg, false, reg.TTL(), time.Unix(0, 0))
		if err != nil {
			t.Fatalf("registration %q decoded but not admitted: %v", body, err)
		}
		defer b.up.close()
		host, port, err := net.SplitHostPort(b.addr)
		if n, perr := strconv.Atoi(port); err != nil || perr != nil || host == "" || n < 1 || n > 65535 {
			t.Fatalf("registration %q admitted backend address %q", body, b.addr)
		}
		if len(b.ranks) != reg.DPSize || b.pickRank() >= reg.DPSize {
			t.Fatalf("registration %q: %d ranks for dp_size %d", body, len(b.ranks), reg.DPSize)
		}
		if _, err := json.Marshal(b.info(time.Unix(0, 0))); err != nil {
			t.Fatalf("backend info of %q: %v", body, err)
		}
	})
}

func FuzzDeregister(f *testing.F) {
	f.Add([]byte(`{"role":"pd","url":"http://h:8100"}`))
	f.Add([]byte(`{"url":""}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		in, err := decodeDeregister(body)
		if err == nil && in.URL == "" {
			t.Fatalf("deregister %q accepted without a url", body)
		}
	})
}
