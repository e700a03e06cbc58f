package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// postAs sends a chat request with the given headers.
func (r *rig) postAs(body string, headers map[string]string) (int, []byte) {
	r.t.Helper()
	req, err := http.NewRequest(http.MethodPost, r.url+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(r.t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := r.httpc.Do(req)
	require.NoError(r.t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(r.t, err)
	return resp.StatusCode, out
}

// partKeys returns every content part's uuid in a request body, in order.
func partKeys(t *testing.T, body []byte) []string {
	t.Helper()
	var b struct {
		Messages []struct {
			Content []map[string]any `json:"content"`
		} `json:"messages"`
	}
	require.NoError(t, json.Unmarshal(body, &b))
	var keys []string
	for _, m := range b.Messages {
		for _, p := range m.Content {
			if k, ok := p["uuid"].(string); ok {
				keys = append(keys, k)
			}
		}
	}
	return keys
}

func chatWith(parts ...string) string {
	return `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},` + strings.Join(parts, ",") + `]}]}`
}

func bearerAuth(tok string) map[string]string {
	return map[string]string{"Authorization": "Bearer " + tok}
}

// The attack: two clients name the same key for different images. Under
// trust both reach the encoder and the PD under that one key, so whatever
// is cached for it (encoder cache, prefix cache, the transfer's dedup)
// serves the second client the first one's embeddings. Namespaced, they
// never meet; one client sending its key again meets itself.
func TestClientKeysAreKeptApartPerTenant(t *testing.T) {
	imgA := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QUFBQQ=="},"uuid":"shared-key"}`
	imgB := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QkJCQg=="},"uuid":"shared-key"}`
	keysSeen := func(policy string) (encA, encB, pdA, pdB, pdA2 string) {
		r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.ClientMediaKeys = policy }})
		send := func(part, tok string) (string, string) {
			r.enc[0].Reset()
			r.pd[0].Reset()
			code, body := r.postAs(chatWith(part), bearerAuth(tok))
			require.Equal(t, 200, code, string(body))
			enc, pd := r.enc[0].Calls(), r.pd[0].Calls()
			require.Len(t, enc, 1)
			require.Len(t, pd, 1)
			ek, pk := partKeys(t, enc[0].Body), partKeys(t, pd[0].Body)
			require.Len(t, ek, 1)
			require.Len(t, pk, 1)
			return ek[0], pk[0]
		}
		encA, pdA = send(imgA, "tenant-a")
		encB, pdB = send(imgB, "tenant-b")
		_, pdA2 = send(imgA, "tenant-a")
		return
	}

	encA, encB, pdA, pdB, _ := keysSeen(KeysTrust)
	require.Equal(t, "shared-key", encA)
	require.Equal(t, encA, encB, "trust: both clients' images reach the encoder under one key")
	require.Equal(t, pdA, pdB, "trust: the PD is asked for the same item for two different images")

	encA, encB, pdA, pdB, pdA2 := keysSeen(KeysNamespace)
	require.NotEqual(t, "shared-key", encA)
	require.NotEqual(t, "shared-key", encB)
	require.NotEqual(t, encA, encB, "namespace: the second tenant's key is not the first one's")
	require.NotEqual(t, pdA, pdB)
	require.Equal(t, pdA, pdA2, "namespace: one tenant's repeated key still meets itself (reuse within a tenant)")
	require.NotContains(t, encA, "tenant-a", "the key names neither the tenant nor its credential")
}

// The rewrite changes the key and nothing else in the part: the image's
// bytes go on as the client sent them.
func TestNamespacedPartIsTheClientsPartWithAnotherKey(t *testing.T) {
	big := strings.Repeat("QUJD", 200) // above jsonWriter's copy threshold
	part := `{ "type" : "image_url", "uuid" : "k1", "image_url" : {"url":"data:image/png;base64,` + big + `"} }`
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	code, body := r.postAs(chatWith(part), bearerAuth("t"))
	require.Equal(t, 200, code, string(body))
	var enc struct {
		Messages []struct {
			Content []json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	require.NoError(t, json.Unmarshal(r.enc[0].Calls()[0].Body, &enc))
	got := enc.Messages[0].Content[0]
	key := partKeys(t, r.enc[0].Calls()[0].Body)[0]
	require.Equal(t, strings.Replace(part, `"k1"`, `"`+key+`"`, 1), string(got))
}

func TestClientKeyPolicies(t *testing.T) {
	img := `{"type":"image_url","image_url":{"url":"http://img/1.png"},"uuid":"k"}`
	escaped := `{"type":"image_url","image_url":{"url":"http://img/1.png"},"\u0075uid":"k"}`
	embeds := `{"type":"image_embeds","image_embeds":"UEsDBBQAAAAIAA==","uuid":"k"}` // a client's own tensor
	cases := []struct {
		name    string
		mut     func(*Config)
		part    string
		headers map[string]string
		status  int
		want    string // in the error, or the key the PD sees ("" = namespaced)
	}{
		{"refuse", func(c *Config) { c.ClientMediaKeys = KeysRefuse }, img, bearerAuth("a"), 400, "client_media_keys=refuse"},
		{"namespace without a tenant", nil, img, nil, 400, "names no tenant"},
		{"escaped key is a key", nil, escaped, nil, 400, "names no tenant"},
		{"tenant header missing", func(c *Config) { c.TenantHeader = "X-Tenant" }, img, bearerAuth("a"), 400, "no X-Tenant header"},
		{"tenant header", func(c *Config) { c.TenantHeader = "X-Tenant" }, img, map[string]string{"X-Tenant": "acme"}, 200, ""},
		{"embeds part namespaced", nil, embeds, bearerAuth("a"), 200, ""},
		{"escaped key namespaced", nil, escaped, bearerAuth("a"), 200, ""},
		{"null key is no key", nil, `{"type":"image_url","image_url":{"url":"http://img/1.png"},"uuid":null}`, nil, 200, "-"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: tc.mut})
			code, body := r.postAs(chatWith(tc.part), tc.headers)
			require.Equal(t, tc.status, code, string(body))
			if code != 200 {
				require.Contains(t, string(body), tc.want)
				require.Empty(t, r.enc[0].Calls(), "a refused request reaches no backend")
				require.Empty(t, r.pd[0].Calls())
				return
			}
			pd := r.pd[0].Calls()
			require.Len(t, pd, 1)
			keys := partKeys(t, pd[0].Body)
			if tc.want == "-" {
				require.NotContains(t, keys, "k")
				return
			}
			require.Len(t, keys, 1)
			require.NotEqual(t, "k", keys[0])
			require.True(t, strings.HasPrefix(keys[0], "t-"), keys[0])
			if strings.Contains(tc.part, "image_embeds") {
				require.Empty(t, r.enc[0].Calls(), "an embeds part is not encoded")
				require.False(t, bytes.Contains(pd[0].Body, []byte(`"k"`)))
			}
		})
	}
}

func TestClientKeysConfig(t *testing.T) {
	_, err := DecodeConfig([]byte(`{"pd":["http://127.0.0.1:1"],"client_media_keys":"open"}`))
	require.ErrorContains(t, err, "client_media_keys")
	_, err = DecodeConfig([]byte(`{"pd":["http://127.0.0.1:1"],"tenant_header":"X Tenant"}`))
	require.ErrorContains(t, err, "tenant_header")
	c, err := DecodeConfig([]byte(`{"pd":["http://127.0.0.1:1"]}`))
	require.NoError(t, err)
	require.Equal(t, KeysNamespace, c.ClientMediaKeys, "safe by default")
}
