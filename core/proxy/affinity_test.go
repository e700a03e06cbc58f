package proxy

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

// Which PD each of the requests went to, by index into r.pd.
func pdOf(t *testing.T, r *rig) []int {
	t.Helper()
	var got []int
	for i, pd := range r.pd {
		for range pd.Calls() {
			got = append(got, i)
		}
	}
	return got
}

// A repeated image goes back to the PD that served it, where its encoder
// output (and its prefix) is; least-loaded routing alone, with both PDs
// idle, rotates it between them.
func TestRepeatedImageGoesBackToItsPD(t *testing.T) {
	img := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QUFBQQ=="}}`
	for _, entries := range []int{0, 1 << 10} {
		t.Run(fmt.Sprintf("affinity_entries=%d", entries), func(t *testing.T) {
			r := newRig(t, rigOpts{encoders: 1, pds: 2, mut: func(c *Config) { c.AffinityEntries = entries }})
			for range 6 {
				code, body := r.postAs(chatWith(img), nil)
				require.Equal(t, 200, code, string(body))
			}
			served := map[int]int{}
			for _, i := range pdOf(t, r) {
				served[i]++
			}
			m := ecmLines(metricsText(t, r.url))
			if entries == 0 {
				require.Len(t, served, 2, "without affinity, idle PDs share the repeats: %v", served)
				require.Contains(t, m, `ecm_proxy_routing_total{reason="least_loaded"} 6`)
				return
			}
			require.Len(t, served, 1, "every repeat on the PD that served the image first: %v", served)
			require.Contains(t, m, `ecm_proxy_routing_total{reason="affinity"} 5`)
			require.Contains(t, m, `ecm_proxy_routing_total{reason="least_loaded"} 1`)
			require.Contains(t, m, `ecm_proxy_affinity_entries 1`)
		})
	}
}

// ecmLines keeps the proxy's own series of a /metrics text, so that a
// failure prints what matters.
func ecmLines(text string) []string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, "ecm_proxy_routing") || strings.HasPrefix(l, "ecm_proxy_affinity") {
			out = append(out, l)
		}
	}
	return out
}

func testPool(t *testing.T, inflight ...int64) *pool {
	t.Helper()
	pl := &pool{role: discovery.RolePD, threshold: 3}
	for i, n := range inflight {
		b, _, err := pl.add(discovery.Registration{Role: discovery.RolePD, URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i), DPSize: 1, TPSize: 1}, true, 0, time.Unix(0, 0))
		require.NoError(t, err)
		t.Cleanup(b.up.close)
		b.inflight.Store(n)
	}
	return pl
}

// The holder of most items wins while its load is within the slack of the
// least loaded PD; beyond it, load wins. Unhealthy and excluded holders
// never win.
func TestPickAffineWeighsLoad(t *testing.T) {
	url := func(i int) string { return fmt.Sprintf("http://127.0.0.1:%d", 9000+i) }
	cases := []struct {
		name     string
		inflight []int64
		holders  map[string]int
		exclude  []int
		want     int
		reason   string
	}{
		{"no holder", []int64{3, 1, 2}, nil, nil, 1, "least_loaded"},
		{"holder within slack", []int64{3, 1, 2}, map[string]int{url(0): 1}, nil, 0, "affinity"},
		{"holder past slack", []int64{4, 1, 2}, map[string]int{url(0): 1}, nil, 1, "affinity_overloaded"},
		{"most items wins", []int64{1, 1, 1}, map[string]int{url(0): 1, url(2): 2}, nil, 2, "affinity"},
		{"equal holders: less loaded", []int64{2, 1, 0}, map[string]int{url(0): 1, url(1): 1}, nil, 1, "affinity"},
		{"excluded holder", []int64{0, 1, 2}, map[string]int{url(2): 3}, []int{2}, 0, "least_loaded"},
		{"unknown holder (deregistered)", []int64{1, 0}, map[string]int{"http://gone:1": 2}, nil, 1, "least_loaded"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl := testPool(t, tc.inflight...)
			exclude := map[*backend]bool{}
			for _, i := range tc.exclude {
				exclude[pl.list[i]] = true
			}
			got, reason := pl.pickAffine(exclude, tc.holders, 2)
			require.Equal(t, url(tc.want), got.reg.URL)
			require.Equal(t, tc.reason, reason)
		})
	}
	pl := testPool(t, 0, 0)
	pl.list[0].healthy = false
	got, reason := pl.pickAffine(nil, map[string]int{url(0): 1}, 2)
	require.Equal(t, url(1), got.reg.URL, "an unhealthy holder is passed over")
	require.Equal(t, "least_loaded", reason)
}

// The map holds at most its bound, forgets the least recently routed item
// first, and ignores entries past their age.
func TestAffinityIsBounded(t *testing.T) {
	a := newAffinity(4, time.Minute)
	t0 := time.Unix(1000, 0)
	key := func(i int) itemKey { return itemKey{byte(i)} }
	for i := range 10 {
		a.note("http://pd", []itemKey{key(i)}, nil, t0)
	}
	n, evicted := a.size()
	require.Equal(t, 4, n)
	require.Equal(t, int64(6), evicted)
	require.Empty(t, a.holders([]itemKey{key(0), key(5)}, t0), "the oldest are forgotten")
	require.Equal(t, map[string]int{"http://pd": 2}, a.holders([]itemKey{key(6), key(9)}, t0))
	a.note("http://pd2", []itemKey{key(6)}, nil, t0)
	require.Equal(t, map[string]int{"http://pd2": 1}, a.holders([]itemKey{key(6)}, t0), "the latest PD counts")
	require.Empty(t, a.holders([]itemKey{key(9)}, t0.Add(2*time.Minute)), "an entry past its age counts for nothing")
	off := newAffinity(0, time.Minute)
	off.note("http://pd", []itemKey{key(1)}, nil, t0)
	require.Empty(t, off.holders([]itemKey{key(1)}, t0))
}

// Items are named as the encoder sees them: the same part under another
// model, or another tenant's client-chosen key, is another item.
func TestItemKeys(t *testing.T) {
	keysOf := func(body, tenant string) []itemKey {
		r, err := parseRequest([]byte(body), true)
		require.NoError(t, err)
		if tenant != "" {
			_, err = r.applyKeys(KeysNamespace, tenant)
			require.NoError(t, err)
		}
		return r.itemKeys()
	}
	img := `{"type":"image_url","image_url":{"url":"http://img/1.png"}}`
	keyed := `{"type":"image_url","image_url":{"url":"http://img/1.png"},"uuid":"k"}`
	a := keysOf(`{"model":"m","messages":[{"role":"user","content":[`+img+`]}]}`, "")
	require.Len(t, a, 1)
	require.Equal(t, a, keysOf(`{"model":"m","stream":true,"messages":[{"role":"user","content":[ `+img+` ]}]}`, ""), "generation fields and whitespace do not matter")
	require.NotEqual(t, a, keysOf(`{"model":"m2","messages":[{"role":"user","content":[`+img+`]}]}`, ""))
	t1 := keysOf(`{"model":"m","messages":[{"role":"user","content":[`+keyed+`]}]}`, "tenant-1")
	require.Equal(t, t1, keysOf(`{"model":"m","messages":[{"role":"user","content":[`+keyed+`]}]}`, "tenant-1"))
	require.NotEqual(t, t1, keysOf(`{"model":"m","messages":[{"role":"user","content":[`+keyed+`]}]}`, "tenant-2"))
}

// An image the picked PD already holds is not encoded again: the PD gets
// the client's media part under the identifier the encoder gave it the
// first time, which is the key vLLM computes for it anyway.
func TestRepeatedImageIsNotEncodedAgainAtItsHolder(t *testing.T) {
	plain := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QUFBQQ=="}}`
	keyed := `{"type":"image_url","uuid":"mine","image_url":{"url":"data:image/png;base64,QkJCQg=="}}`
	for _, reuse := range []bool{false, true} {
		for _, part := range []string{plain, keyed} {
			t.Run(fmt.Sprintf("reuse=%v/keyed=%v", reuse, part == keyed), func(t *testing.T) {
				r := newRig(t, rigOpts{encoders: 1, pds: 2, mut: func(c *Config) { c.AffinityEntries, c.AffinityReuse = 1<<10, reuse }})
				for range 3 {
					code, body := r.postAs(chatWith(part, part), bearerAuth("t"))
					require.Equal(t, 200, code, string(body))
				}
				enc := r.enc[0].Calls()
				if !reuse {
					require.Len(t, enc, 3, "without reuse every request encodes its image")
					return
				}
				require.Len(t, enc, 1, "the image is encoded once")
				id := partKeys(t, enc[0].Body)
				var first []string
				var pds [][]byte
				for _, pd := range r.pd {
					for _, c := range pd.Calls() {
						pds = append(pds, c.Body)
					}
				}
				require.Len(t, pds, 3)
				first = partKeys(t, pds[0])
				require.Len(t, first, 2, "the first request: both places are embeds of the pushed item")
				for _, body := range pds[1:] {
					var b struct {
						Messages []struct {
							Content []json.RawMessage `json:"content"`
						} `json:"messages"`
						P json.RawMessage `json:"ec_transfer_params"`
					}
					require.NoError(t, json.Unmarshal(body, &b))
					require.Nil(t, b.P, "nothing to wait for: no push")
					for _, got := range b.Messages[0].Content[1:] {
						var want map[string]any
						require.NoError(t, json.Unmarshal([]byte(part), &want))
						want["uuid"] = first[0]
						require.JSONEq(t, mustJSON(t, want), string(got), "the client's media under the pushed item's identifier")
					}
				}
				if part == keyed {
					require.Equal(t, id, first[:1], "a keyed part's identifier is its namespaced key")
				}
				m := metricsText(t, r.url)
				require.Contains(t, m, `ecm_proxy_media_items_total{outcome="reused"} 2`)
				require.Contains(t, m, `ecm_proxy_media_items_total{outcome="encoded"} 1`)
			})
		}
	}
}

// An image encoded before whose holder is busier than the slack allows is
// sent to the least-loaded PD as an item that PD gets from Mooncake Store
// itself (store_reuse): no encoder call, the client's media under the
// item's identifier (to encode it with should the Store not hold it), and
// an ec_items entry with a fresh transfer id and "source": "store". Off,
// or for a PD older than vLLM 0.30, the image is encoded again.
func TestRepeatedImageAtAnotherPDComesFromTheStore(t *testing.T) {
	img := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QUFBQQ=="}}`
	for _, tc := range []struct {
		name    string
		store   bool
		version string
		want    bool
	}{
		{"store_reuse", true, "0.33.0", true},
		{"store_reuse off", false, "0.33.0", false},
		{"vLLM 0.29 PD", true, "0.29.0", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{encoders: 1, pds: 2, fake: fakevllm.Config{Version: tc.version}, mut: func(c *Config) {
				c.AffinityEntries, c.AffinitySlack, c.StoreReuse = 1<<10, 0, tc.store
			}})
			code, body := r.postAs(chatWith(img), nil)
			require.Equal(t, 200, code, string(body))
			first := pdOf(t, r)
			require.Len(t, first, 1)
			var holder *backend
			for _, b := range r.p.consumers().list {
				if b.reg.URL == r.pd[first[0]].URL() {
					holder = b
				}
			}
			require.NotNil(t, holder)
			// The holder is busy: one request in flight, over a slack of 0.
			holder.inflight.Add(1)
			defer holder.inflight.Add(-1)
			code, body = r.postAs(chatWith(img), nil)
			require.Equal(t, 200, code, string(body))
			other := r.pd[1-first[0]].Calls()
			require.Len(t, other, 1, "the repeat goes to the least-loaded PD")
			m := metricsText(t, r.url)
			require.Contains(t, m, `ecm_proxy_routing_total{reason="affinity_overloaded"} 1`)
			if !tc.want {
				require.Len(t, r.enc[0].Calls(), 2, "the image is encoded again")
				require.NotContains(t, m, `outcome="store"`)
				return
			}
			require.Len(t, r.enc[0].Calls(), 1, "no encoder call for the repeat")
			id := partKeys(t, r.pd[first[0]].Calls()[0].Body) // the embeds part of the pushed item
			require.Len(t, id, 1)
			var b struct {
				Messages []struct {
					Content []json.RawMessage `json:"content"`
				} `json:"messages"`
				P struct {
					Items []map[string]string `json:"ec_items"`
				} `json:"ec_transfer_params"`
			}
			require.NoError(t, json.Unmarshal(other[0].Body, &b))
			var want map[string]any
			require.NoError(t, json.Unmarshal([]byte(img), &want))
			want["uuid"] = id[0]
			require.JSONEq(t, mustJSON(t, want), string(b.Messages[0].Content[1]), "the client's media under the item's identifier")
			require.Len(t, b.P.Items, 1)
			item := b.P.Items[0]
			require.Equal(t, id[0], item["mm_hash"])
			require.Equal(t, "store", item["source"])
			require.NotEmpty(t, item["transfer_id"])
			require.Contains(t, m, `ecm_proxy_media_items_total{outcome="store"} 1`)
			require.Contains(t, m, `ecm_proxy_media_items_total{outcome="encoded"} 1`)
			// The PD that got it is its holder now: a third request goes
			// there (the first holder is still busy) as a plain reuse.
			code, body = r.postAs(chatWith(img), nil)
			require.Equal(t, 200, code, string(body))
			require.Len(t, r.enc[0].Calls(), 1)
			require.Contains(t, metricsText(t, r.url), `ecm_proxy_media_items_total{outcome="reused"} 1`)
		})
	}
}
