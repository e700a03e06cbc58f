package proxy

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestClassify(t *testing.T) {
	cases := []struct {
		name string
		ev   string
		want eventKind
	}{
		{"role-only chunk is held", `data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}` + "\n\n", eventHold},
		{"keep-alive comment is held", ": ping\n\n", eventHold},
		{"token commits", `data: {"choices":[{"delta":{"content":"Hi"}}]}` + "\n\n", eventCommit},
		{"completion text commits", `data: {"choices":[{"text":"Hi","finish_reason":null}]}` + "\n\n", eventCommit},
		{"reasoning commits", `data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}` + "\n\n", eventCommit},
		{"tool call commits", `data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}` + "\n\n", eventCommit},
		{"finish reason commits", `data: {"choices":[{"delta":{},"finish_reason":"length"}]}` + "\n\n", eventCommit},
		{"usage-only chunk commits", `data: {"choices":[],"usage":{"total_tokens":3}}` + "\n\n", eventCommit},
		{"done commits", "data: [DONE]\n\n", eventCommit},
		{"500 error retries", `data: {"error":{"message":"Internal server error","type":"InternalServerError","code":500}}` + "\n\n", eventRetry},
		{"503 error retries", `data: {"error":{"message":"retry","type":"ServiceUnavailableError","code":503}}` + "\n\n", eventRetry},
		{"400 error commits", `data: {"error":{"message":"bad","type":"BadRequestError","code":400}}` + "\n\n", eventCommit},
		{"not JSON commits", "data: hello\n\n", eventCommit},
		{"CRLF lines", "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n", eventCommit},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, _ := classify([]byte(tc.ev))
			require.Equal(t, tc.want, got)
		})
	}
}

func TestSSEReaderSplitsEvents(t *testing.T) {
	in := "\n\ndata: a\n\n: comment\n\ndata: b\ndata: c\n\ndata: tail"
	r := newSSEReader(strings.NewReader(in))
	var got []string
	for {
		ev, err := r.next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		got = append(got, string(ev))
	}
	require.Equal(t, []string{"data: a\n\n", ": comment\n\n", "data: b\ndata: c\n\n", "data: tail"}, got)
}

func TestConfigValidation(t *testing.T) {
	decodeCases{
		"defaults with a pd":          {`{"pd": ["http://h:8100"]}`, ""},
		"fragment layout":             {`{"pd": ["http://h:8100#ec=tcp://h:15000&tp_size=2&dp_size=4"]}`, ""},
		"unknown key":                 {`{"pdd": []}`, "unknown field"},
		"https backend":               {`{"pd": ["https://h:8100"]}`, "want http://host:port"},
		"backend with a path":         {`{"pd": ["http://a:1"], "encode": ["http://h:8100/v1"]}`, "no path"},
		"bad fragment key":            {`{"pd": ["http://h:8100#colour=red"]}`, "unknown fragment key"},
		"pd and prefill":              {`{"pd": ["http://a:1"], "prefill": ["http://b:1"], "decode": ["http://c:1"]}`, "not both"},
		"prefill without decode":      {`{"prefill": ["http://b:1"]}`, "go together"},
		"negative retries":            {`{"pd": ["http://a:1"], "retries": -1}`, "retries"},
		"no consumer, no discovery":   {`{"allow_register": false}`, "nothing could serve"},
		"bad ec in fragment":          {`{"pd": ["http://h:1#ec=udp://h:2"]}`, "tcp://host:port"},
		"zero idle timeout":           {`{"pd": ["http://a:1"], "upstream_idle_timeout_s": 0}`, "upstream_idle_timeout_s"},
		"negative health timeout":     {`{"pd": ["http://a:1"], "health_timeout_s": -1}`, "health_timeout_s"},
		"a health timeout of its own": {`{"pd": ["http://a:1"], "health_interval_s": 0.05, "health_timeout_s": 30}`, ""},
	}.check(t)
	c, err := DecodeConfig([]byte(`{"pd": ["http://[::1]:8100"]}`))
	require.NoError(t, err)
	reg, err := c.static("pd", c.PD[0])
	require.NoError(t, err)
	require.Equal(t, "tcp://[::1]:14579", reg.Consumer, "IPv6 hosts are bracketed")
}

func TestParseEncoderReply(t *testing.T) {
	cases := map[string]struct {
		body, want, err string
	}{
		"entry naming the transfer":  {`{"ec_transfer_params":{"h1":{"modality":"image","metadata":{"a":[1]},"transfer_id":"t"},"h2":{"modality":"image","transfer_id":"u"}}}`, "h1", ""},
		"single entry without an id": {`{"ec_transfer_params":{"h1":{"modality":"audio"}}}`, "h1", ""},
		"no params":                  {`{"choices":[]}`, "", "no ec_transfer_params"},
		"other transfer only":        {`{"ec_transfer_params":{"h1":{"modality":"image","transfer_id":"u"}}}`, "", "none of them transfer t"},
		"unknown modality":           {`{"ec_transfer_params":{"h1":{"modality":"smell","transfer_id":"t"}}}`, "", "modality"},
		"not json":                   {`<html>`, "", "not JSON"},
		"no modality, none sent":     {`{"ec_transfer_params":{"h1":{"item_indices":[0],"transfer_id":"t"}}}`, "", "modality"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			e, err := parseEncoderReply([]byte(tc.body), "t", "")
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, e.identifier)
			require.Equal(t, "t", e.transferID)
			require.NotEmpty(t, e.metadata)
			require.Empty(t, e.derived)
		})
	}
}

// vLLM 0.32's encoder leaves modality out of each item's entry: the proxy
// takes it from the media part it sent, and says so.
func TestParseEncoderReplyDerivesModality(t *testing.T) {
	body := `{"ec_transfer_params":{"h1":{"item_indices":[0],"metadata":{},"transfer_id":"t"}}}`
	e, err := parseEncoderReply([]byte(body), "t", "image")
	require.NoError(t, err)
	require.Equal(t, "image", e.modality)
	require.Equal(t, []string{"modality"}, e.derived)

	// The encoder's own answer wins over the part's type.
	body = `{"ec_transfer_params":{"h1":{"modality":"video","transfer_id":"t"}}}`
	e, err = parseEncoderReply([]byte(body), "t", "image")
	require.NoError(t, err)
	require.Equal(t, "video", e.modality)
	require.Empty(t, e.derived)

	r, err := parseRequest([]byte(`{"messages":[{"role":"user","content":[
		{"type":"image_url","image_url":{"url":"a"}},{"type":"input_audio","input_audio":{}},
		{"type":"video_url","video_url":{"url":"v"}}]}]}`), true)
	require.NoError(t, err)
	require.Equal(t, []string{"image", "audio", "video"}, []string{r.modality(0), r.modality(1), r.modality(2)})
}

// Request bodies come from the network: no input may panic the parser or
// the rewrite, and a rewrite must stay valid JSON.
func FuzzRewrite(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"t"}]}]}`))
	f.Add([]byte(`{"messages":"x"}`))
	f.Add([]byte(`{"messages":[{"content":[{"type":"input_audio"},{"type":"input_audio"}]}]}`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`{"messages":[{"content":[{"type":"image_url","image_url":{"url":"x"},"uuid":"k"},{"type":"image_embeds","image_embeds":"AA","\u0075uid":"k"}]}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := parseRequest(body, true)
		if err != nil {
			return
		}
		// Client keys namespaced: each rewritten part is the client's
		// part with only its uuid changed.
		if _, err := r.applyKeys(KeysNamespace, "t"); err != nil {
			require.ErrorIs(t, err, errClientKey)
			return
		}
		for _, k := range r.keyRefs {
			orig, ok := objectMembers(r.parts[k.msg][k.part])
			require.True(t, ok)
			got, ok := objectMembers(r.partBody(k.msg, k.part).bytes())
			require.True(t, ok, "rewritten part %q", r.partBody(k.msg, k.part).bytes())
			var key string
			require.NoError(t, json.Unmarshal(orig["uuid"], &key))
			require.Equal(t, `"`+namespacedKey("t", key)+`"`, string(got["uuid"]))
			delete(orig, "uuid")
			delete(got, "uuid")
			require.Equal(t, orig, got)
		}
		// The parser splits without copying; what it finds is what
		// encoding/json finds.
		var want map[string]json.RawMessage
		if err := json.Unmarshal(body, &want); err != nil {
			t.Fatalf("parsed %q, which encoding/json refuses: %v", body, err)
		}
		require.Equal(t, len(want), len(r.top), "members of %q", body)
		for k, v := range want {
			require.Equal(t, string(v), string(r.top[k]), "member %q of %q", k, body)
		}
		for _, p := range r.items {
			var c bytes.Buffer
			require.NoError(t, json.Compact(&c, p))
			sum := sha256.Sum256(c.Bytes())
			require.Equal(t, string(sum[:]), compactSum(p), "the digest of %q is that of its compact form", p)
		}
		// Every other item reused under an identifier: each of its places
		// is the part as namespaced, with that identifier as its uuid.
		reuse := make([]string, len(r.items))
		for i := range reuse {
			if i%2 == 1 {
				reuse[i] = fmt.Sprintf("id-%d", i)
			}
		}
		before := map[[2]int][]byte{}
		for _, ref := range r.refs {
			before[[2]int{ref.msg, ref.part}] = r.partBody(ref.msg, ref.part).bytes()
		}
		require.NoError(t, r.reuseAt(reuse))
		for _, ref := range r.refs {
			got, ok := objectMembers(r.partBody(ref.msg, ref.part).bytes())
			require.True(t, ok, "part %q after reuse", r.partBody(ref.msg, ref.part).bytes())
			want, ok := objectMembers(before[[2]int{ref.msg, ref.part}])
			require.True(t, ok)
			if reuse[ref.item] != "" {
				require.Equal(t, `"`+reuse[ref.item]+`"`, string(got["uuid"]))
				delete(got, "uuid")
				delete(want, "uuid")
			}
			require.Equal(t, len(want), len(got))
			for k, v := range want {
				require.JSONEq(t, string(v), string(got[k]))
			}
		}
		for i := range r.items {
			eb, err := r.encoderBody(i, "tcp://h:1", "t")
			if err != nil {
				t.Fatalf("encoder body: %v", err)
			}
			if !json.Valid(eb.bytes()) {
				t.Fatalf("encoder body %q is not JSON", eb.bytes())
			}
		}
		done := make([]*encoded, len(r.items))
		for i := range done {
			done[i] = &encoded{identifier: "h", modality: "image", metadata: []byte(`{}`), entry: []byte(`{}`), transferID: "t"}
		}
		top, _, err := r.consumerTop(done, true)
		if err != nil {
			t.Fatalf("rewrite: %v", err)
		}
		if out := marshalTop(top).bytes(); !json.Valid(out) {
			t.Fatalf("consumer body %q is not JSON", out)
		}
	})
}

func FuzzEncoderReply(f *testing.F) {
	f.Add([]byte(`{"ec_transfer_params":{"h1":{"modality":"image","metadata":{"a":[1]},"transfer_id":"t"}}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		_, _ = parseEncoderReply(body, "t", "image")
		_, _ = classify(body)
	})
}

// A port that cannot be had fails Open with an error, never a panic, and
// the ports already taken are given back.
func TestOpenFailsCleanlyWhenAPortIsTaken(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	for name, mut := range map[string]func(*Config){
		"metrics port": func(c *Config) { c.MetricsPort = port },
		"admin port":   func(c *Config) { c.AdminPort = port },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Host, cfg.Port = "127.0.0.1", 0
			cfg.PD = []string{"http://127.0.0.1:1"}
			cfg.RegisterToken = "a-register-token-of-some-length"
			mut(&cfg)
			p, err := Open(cfg, nil)
			require.Error(t, err)
			require.Nil(t, p)
			require.Contains(t, err.Error(), "address already in use")
		})
	}
}

// A /version answer comes from the network: nothing may panic its parser,
// and what it returns is a version only when the body said so.
func FuzzVersionReply(f *testing.F) {
	f.Add([]byte(`{"version":"0.26.0"}`))
	f.Add([]byte(`{"version":3}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		v := parseVersionReply(body)
		if v != "" && !json.Valid(body) {
			t.Fatalf("version %q from a body that is not JSON: %q", v, body)
		}
	})
}
