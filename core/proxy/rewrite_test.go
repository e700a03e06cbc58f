package proxy

import (
	"encoding/json"
	"fmt"
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"
)

// The exact requests the encoder and the consumer receive, for the prompt
// shapes that matter. Expected bodies are built by hand from the transfer
// ids the encoder calls carried, so any change in the rewrite shows up here.
func TestRewrittenRequests(t *testing.T) {
	img1, img2 := image("http://img/1.png"), image("data:image/png;base64,AAAA")
	audio := map[string]any{"type": "input_audio", "input_audio": map[string]any{"data": "UklGRg==", "format": "wav"}}
	withUUID := map[string]any{"type": "image_url", "image_url": map[string]any{"url": "http://img/3.png"}, "uuid": "client-uuid-3"}
	cases := []struct {
		name  string
		parts []map[string]any
		// distinct media in first-appearance order, and each media part's
		// index into it, in prompt order
		distinct []map[string]any
		places   []int
	}{
		{"text only", []map[string]any{text("hello")}, nil, nil},
		{"single image", []map[string]any{text("what is this?"), img1}, []map[string]any{img1}, []int{0}},
		{"multi image", []map[string]any{img1, text("and"), img2}, []map[string]any{img1, img2}, []int{0, 1}},
		{"duplicate image", []map[string]any{img1, img2, img1}, []map[string]any{img1, img2}, []int{0, 1, 0}},
		{"image and audio", []map[string]any{audio, img1}, []map[string]any{audio, img1}, []int{0, 1}},
		// With client_media_keys=trust; keys_test.go has the other policies.
		{"client uuid kept", []map[string]any{withUUID}, []map[string]any{withUUID}, []int{0}},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				r := newRig(t, rigOpts{encoders: 2, pds: 1, mut: func(c *Config) { c.ClientMediaKeys = KeysTrust }})
				req := chat(stream, tc.parts...)
				code, body := r.post("/v1/chat/completions", req)
				require.Equal(t, 200, code, string(body))
				pdCalls := r.pd[0].Calls()
				require.Len(t, pdCalls, 1)
				got := pdCalls[0]
				if len(tc.distinct) == 0 {
					require.JSONEq(t, mustJSON(t, req), string(got.Body), "text-only bodies go through unchanged")
					require.Empty(t, r.enc[0].Calls())
					require.Empty(t, r.enc[1].Calls())
					return
				}
				require.NotEmpty(t, got.RequestID)

				// One encoder call per distinct item, spread over both
				// encoders. Transfer ids are random, so each is learned
				// from the encoder call that carries its item's part.
				encBodies := map[string]string{}
				tids := map[int]string{}
				for _, e := range r.enc {
					for _, c := range e.Calls() {
						var b struct {
							Messages []struct {
								Content []json.RawMessage `json:"content"`
							} `json:"messages"`
							P struct {
								Items []struct {
									TransferID string `json:"transfer_id"`
								} `json:"ec_items"`
							} `json:"ec_transfer_params"`
						}
						require.NoError(t, json.Unmarshal(c.Body, &b))
						tid := b.P.Items[0].TransferID
						encBodies[tid] = string(c.Body)
						for i, part := range tc.distinct {
							if len(b.Messages) == 1 && len(b.Messages[0].Content) == 1 && jsonEqual(t, mustJSON(t, part), string(b.Messages[0].Content[0])) {
								tids[i] = tid
							}
						}
					}
				}
				tid := func(i int) string {
					require.Contains(t, tids, i, "no encoder call carried item %d", i)
					return tids[i]
				}
				require.Len(t, encBodies, len(tc.distinct))
				for i, part := range tc.distinct {
					want := map[string]any{
						"model": "m", "max_tokens": 1, "stream": false,
						"messages": []any{map[string]any{"role": "user", "content": []any{part}}},
						"ec_transfer_params": map[string]any{
							"consumer": "tcp://127.0.0.1:14579", "consumer_zmq": "tcp://127.0.0.1:14579",
							"ec_items": []any{map[string]any{"transfer_id": tid(i)}},
						},
					}
					require.JSONEq(t, mustJSON(t, want), encBodies[tid(i)], "encoder request for item %d", i)
				}

				// The consumer's request: media parts become embeds, in place.
				want := chat(stream, tc.parts...)
				content := want["messages"].([]any)[1].(map[string]any)["content"].([]any)
				var items []any
				params := map[string]any{}
				place := 0
				for pi, p := range tc.parts {
					if p["type"] == "text" {
						continue
					}
					item := tc.places[place]
					place++
					id := partID(t, tc.distinct[item])
					modality := map[string]string{"image_url": "image", "input_audio": "audio"}[p["type"].(string)]
					meta := map[string]any{"image": map[string]any{"image_grid_thw": []int{1, 8, 8}}, "audio": map[string]any{"audio_feature_lengths": []int{50}}}[modality]
					typ := modality + "_embeds"
					content[pi] = map[string]any{"type": typ, typ: meta, "uuid": id}
					items = append(items, map[string]any{"mm_hash": id, "transfer_id": tid(item)})
					params[id] = map[string]any{"modality": modality, "item_indices": []int{0}, "metadata": meta, "transfer_id": tid(item)}
				}
				params["ec_items"] = items
				want["ec_transfer_params"] = params
				require.JSONEq(t, mustJSON(t, want), string(got.Body))
				if stream {
					txt, done, errored := sseText(t, body)
					require.True(t, done)
					require.False(t, errored)
					require.Equal(t, fmt.Sprintf("fake answer with %d embeds and 0 media parts", len(tc.places)), txt)
				}
			})
		}
	}
}

func TestCompletionsGoThroughUnchanged(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	req := map[string]any{"model": "m", "prompt": "Once upon", "max_tokens": 4, "stream": true}
	code, body := r.post("/v1/completions", req)
	require.Equal(t, 200, code)
	txt, done, _ := sseText(t, body)
	require.True(t, done)
	require.Equal(t, "fake answer with 0 embeds and 0 media parts", txt)
	require.JSONEq(t, mustJSON(t, req), string(r.pd[0].Calls()[0].Body))
	require.Equal(t, "/v1/completions", r.pd[0].Calls()[0].Path)
}

func TestBadRequestsAreRefusedByTheProxy(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	for name, body := range map[string]string{"not json": "{", "not an object": "[1,2]"} {
		t.Run(name, func(t *testing.T) {
			resp, err := r.httpc.Post(r.url+"/v1/chat/completions", "application/json", stringReader(body))
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, 400, resp.StatusCode)
		})
	}
	require.Empty(t, r.pd[0].Calls())
}

// jsonEqual reports whether two JSON texts hold the same value.
func jsonEqual(t *testing.T, a, b string) bool {
	t.Helper()
	var x, y any
	require.NoError(t, json.Unmarshal([]byte(a), &x))
	require.NoError(t, json.Unmarshal([]byte(b), &y))
	return reflect.DeepEqual(x, y)
}
