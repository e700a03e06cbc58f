package wire

import (
	"bytes"
	"encoding/json"
	"testing"

	fastjson "github.com/go-json-experiment/json/v1"
	"github.com/stretchr/testify/require"
)

// Every fuzz target checks the two codec invariants: decoding never panics,
// and whatever decodes re-encodes to bytes that decode to an equal value.

// roundTrips checks the invariants on one input.
func roundTrips[T any](t *testing.T, b []byte, decode func([]byte) (T, error), encode func(T) ([]byte, error)) {
	if v, err := decode(b); err == nil {
		reencodes(t, v, decode, encode)
	}
}

// reencodes requires v to encode to bytes that decode to v again.
func reencodes[T any](t *testing.T, v T, decode func([]byte) (T, error), encode func(T) ([]byte, error)) {
	t.Helper()
	b, err := encode(v)
	require.NoError(t, err)
	back, err := decode(b)
	require.NoError(t, err)
	require.Equal(t, v, back)
}

func seedRequests(f *testing.F) {
	for i, tc := range bodies() {
		req, err := NewRequest(uint64(i+1), tc.op, tc.req)
		require.NoError(f, err)
		b, err := EncodeRequest(req)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte(`{"v":1,"id":3,"op":"cancel","body": { "transfer_ids" : [ "a<b" ] } }`))
	f.Add([]byte(`{"v":2,"id":14,"op":"peers"}`))
	f.Add([]byte(`{"v":1,"id":12,"op":"cancel","body":{"transfer_`))
}

func FuzzDecodeRequest(f *testing.F) {
	seedRequests(f)
	f.Fuzz(func(t *testing.T, b []byte) { roundTrips(t, b, DecodeRequest, EncodeRequest) })
}

func FuzzDecodeReply(f *testing.F) {
	for i, tc := range bodies() {
		b, err := EncodeReply(OKReply(uint64(i+1), tc.rep))
		require.NoError(f, err)
		f.Add(b)
	}
	b, err := EncodeReply(ErrReply(0, CodeBadRequest, "not json"))
	require.NoError(f, err)
	f.Add(b)
	f.Add([]byte(`{"v":1,"id":8,"err":"boom"}`))
	f.Fuzz(func(t *testing.T, b []byte) { roundTrips(t, b, DecodeReply, EncodeReply) })
}

func FuzzDecodeEvents(f *testing.F) {
	for _, evs := range eventMessages() {
		b, err := EncodeEvents(evs)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte(`{"v":1,"shard":0,"seq":7,"transfer_id":"t","mm_hash":"h","ready":true,"nbytes":9}`))
	f.Add([]byte{eventTag, Version, 0, 1})
	f.Fuzz(func(t *testing.T, b []byte) { roundTrips(t, b, DecodeEvents, EncodeEvents) })
}

// fuzzBody is the shared body of the per-type body fuzz targets.
func fuzzBody[T interface{ Validate() error }](t *testing.T, b []byte) {
	decode := func(b []byte) (T, error) { return DecodeBody[T](b) }
	encode := func(v T) ([]byte, error) { return marshal(v) }
	roundTrips(t, b, decode, encode)
}

// fuzzBodyOf fuzzes the decoder of body type T (what a shard decodes of a
// request, or a client of a reply), seeded with every body of that type in
// the codec tests and with extra.
func fuzzBodyOf[T interface{ Validate() error }](f *testing.F, extra ...string) {
	for _, tc := range bodies() {
		for _, v := range []any{tc.req, tc.rep} {
			if body, ok := v.(T); ok {
				b, err := json.Marshal(body)
				require.NoError(f, err)
				f.Add(b)
			}
		}
	}
	for _, b := range extra {
		f.Add([]byte(b))
	}
	f.Fuzz(fuzzBody[T])
}

// Request bodies, as the shard decodes them.

func FuzzDecodeReserveBatch(f *testing.F) {
	fuzzBodyOf[ReserveBatch](f, `{"items":[{"transfer_id":"t","mm_hash":"h","nbytes":3,"extra":[1,{"a":null}]}]}`)
}

func FuzzDecodeCompleteBatch(f *testing.F) {
	fuzzBodyOf[CompleteBatch](f, `{"items":[{"transfer_id":"t","token":"00000000000000000000000000000000"}]}`)
}

func FuzzDecodeClaimBatch(f *testing.F) {
	fuzzBodyOf[ClaimBatch](f, `{"requester":"00112233445566778899aabbccddeeff","gen":1,"token":"00000000000000000000000000000001","items":[{"transfer_id":"t","mm_hash":"h","nbytes":1,"offset":18446744073709551615}]}`,
		`{"gen":0,"items":[]}`)
}

func FuzzDecodeClaimBatchReply(f *testing.F) {
	fuzzBodyOf[ClaimBatchReply](f, `{"grants":[],"credit":{"gen":1,"token":"00000000000000000000000000000001","lease_ms":1,"base":18446744073709551615,"extents":[{"off":0,"len":1}]}}`,
		`{"grants":[],"credit":null}`, `{"grants":[],"credit":{"gen":1,"token":"00000000000000000000000000000001","extents":null}}`)
}

func FuzzDecodeCancel(f *testing.F) {
	fuzzBodyOf[Cancel](f, `{"transfer_ids":["a","a"]}`, `{"transfer_ids":[]}`, `{"transfer_ids":null}`, `{"transfer_ids":["\u0000"]}`)
}

func FuzzDecodeStatus(f *testing.F) {
	fuzzBodyOf[Status](f, `{}`, `{"transfer_ids":["t","t"]}`, `{"transfer_ids":[""]}`, `{"transfer_ids":"t"}`)
}

// Reply bodies, as the clients (producer, scheduler) decode them.

func FuzzDecodePeersReply(f *testing.F) {
	fuzzBodyOf[PeersReply](f, `{"shards":[{"rank":0,"control":"tcp://a:1"}],"extra":1}`, `{"shards":[]}`)
}

func FuzzDecodeEventPortReply(f *testing.F) {
	fuzzBodyOf[EventPortReply](f, `{"endpoint":""}`, `{"endpoint":"tcp://[::1]:5","epoch":"e"}`)
}

func FuzzDecodeReserveBatchReply(f *testing.F) {
	fuzzBodyOf[ReserveBatchReply](f, `{"grants":[{"transfer_id":"t","kind":"write","res":1,"nbytes":1}]}`, `{"grants":[],"data":{"":""}}`)
}

func FuzzDecodeCompleteBatchReply(f *testing.F) {
	fuzzBodyOf[CompleteBatchReply](f, `{"results":[{"transfer_id":""}]}`, `{"results":null}`)
}

func FuzzDecodeCancelReply(f *testing.F) {
	fuzzBodyOf[CancelReply](f, `{"cancelled":-1}`, `{"cancelled":1e30}`)
}

func FuzzDecodeStatusReply(f *testing.F) {
	fuzzBodyOf[StatusReply](f, `{"items":[{"transfer_id":"t","known":true}]}`, `{"items":[{"transfer_id":"t","nbytes":-1}]}`)
}

// The codec decodes and encodes with the v2 engine's v1 API
// (github.com/go-json-experiment/json/v1, what encoding/json becomes in
// Go 1.27) for its speed. These targets hold it to encoding/json: the same
// input is accepted or refused by both, what both accept decodes to equal
// values, and both encode those values to the same bytes.
func agreesWithStd[T any](t *testing.T, b []byte) {
	var fast, std T
	errFast, errStd := fastjson.Unmarshal(b, &fast), json.Unmarshal(b, &std)
	require.Equal(t, errStd == nil, errFast == nil, "encoding/json: %v; the codec's decoder: %v", errStd, errFast)
	if errStd != nil {
		return
	}
	require.Equal(t, std, fast)
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	errStd = enc.Encode(std)
	got, errFast := marshal(fast)
	require.Equal(t, errStd == nil, errFast == nil, "encoding/json: %v; the codec's encoder: %v", errStd, errFast)
	if errStd == nil {
		require.Equal(t, string(bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})), string(got))
	}
}

func FuzzRequestAgreesWithStd(f *testing.F) {
	seedRequests(f)
	f.Add([]byte(`{"v":1,"ID":3,"Op":"cancel","id":4,"body":{"transfer_ids":["\xff"]}}`))
	f.Fuzz(agreesWithStd[Request])
}

func FuzzReplyAgreesWithStd(f *testing.F) {
	for i, tc := range bodies() {
		b, err := EncodeReply(OKReply(uint64(i+1), tc.rep))
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte(`{"v":1,"id":8,"err":{"code":"x","msg":"\ud800"}}`))
	f.Fuzz(agreesWithStd[Reply])
}

func FuzzReserveBatchAgreesWithStd(f *testing.F) {
	f.Add([]byte(`{"requester":"r","items":[{"transfer_id":"t","mm_hash":"h","nbytes":3,"meta":"{}","extra":[1,{"a":null}]}],"credit_bytes":1e3}`))
	f.Add([]byte(`{"items":[{"Transfer_ID":"t","mm_hash":"h","mm_hash":"g","nbytes":-1}]}`))
	f.Fuzz(agreesWithStd[ReserveBatch])
}

func FuzzReserveBatchReplyAgreesWithStd(f *testing.F) {
	f.Add([]byte(`{"grants":[{"transfer_id":"t","kind":"write","res":1,"token":"00000000000000000000000000000001","nbytes":1,"addr":5}],"epoch":"e","data":{"tcp":"a:1"},"credit":{"gen":1,"extents":[{"off":0,"len":1}]}}`))
	f.Add([]byte(`{"grants":[{"token":"zz"}]}`))
	f.Fuzz(agreesWithStd[ReserveBatchReply])
}
