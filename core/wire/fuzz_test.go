package wire

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every fuzz target checks the two codec invariants: decoding never panics,
// and whatever decodes re-encodes to bytes that decode to an equal value.

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
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := DecodeRequest(b)
		if err != nil {
			return
		}
		again, err := EncodeRequest(req)
		require.NoError(t, err)
		back, err := DecodeRequest(again)
		require.NoError(t, err)
		require.Equal(t, req, back)
	})
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
	f.Fuzz(func(t *testing.T, b []byte) {
		rep, err := DecodeReply(b)
		if err != nil {
			return
		}
		again, err := EncodeReply(rep)
		require.NoError(t, err)
		back, err := DecodeReply(again)
		require.NoError(t, err)
		require.Equal(t, rep, back)
	})
}

func FuzzDecodeEvent(f *testing.F) {
	for _, ev := range []Event{
		{V: Version, Shard: 0, Seq: 1, TransferID: "t1", MMHash: "h1", Ready: true, NBytes: 1 << 20},
		{V: Version, Shard: 3, Seq: 42, TransferID: "t2", MMHash: "h2", Reason: "abandoned"},
		{V: Version, Kind: EventGone, Shard: 1, Seq: 43, MMHash: "h2", NBytes: 1 << 20, Reason: "evicted"},
	} {
		b, err := EncodeEvent(ev)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := DecodeEvent(b)
		if err != nil {
			return
		}
		again, err := EncodeEvent(ev)
		require.NoError(t, err)
		back, err := DecodeEvent(again)
		require.NoError(t, err)
		require.Equal(t, ev, back)
	})
}

// fuzzBody is the shared body of the per-type body fuzz targets.
func fuzzBody[T interface{ Validate() error }](t *testing.T, b []byte) {
	v, err := DecodeBody[T](b)
	if err != nil {
		return
	}
	again, err := marshal(v)
	require.NoError(t, err)
	back, err := DecodeBody[T](again)
	require.NoError(t, err)
	require.Equal(t, v, back)
}

func seedBody(f *testing.F, pick func(req, rep any) any) {
	for _, tc := range bodies() {
		if v := pick(tc.req, tc.rep); v != nil {
			b, err := json.Marshal(v)
			require.NoError(f, err)
			f.Add(b)
		}
	}
}

func FuzzDecodeReserveBatch(f *testing.F) {
	seedBody(f, func(req, _ any) any {
		if b, ok := req.(ReserveBatch); ok {
			return b
		}
		return nil
	})
	f.Add([]byte(`{"items":[{"transfer_id":"t","mm_hash":"h","nbytes":3,"extra":[1,{"a":null}]}]}`))
	f.Fuzz(fuzzBody[ReserveBatch])
}

func FuzzDecodeCompleteBatch(f *testing.F) {
	seedBody(f, func(req, _ any) any {
		if b, ok := req.(CompleteBatch); ok {
			return b
		}
		return nil
	})
	f.Add([]byte(`{"items":[{"transfer_id":"t","token":"00000000000000000000000000000000"}]}`))
	f.Fuzz(fuzzBody[CompleteBatch])
}
