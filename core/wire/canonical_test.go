package wire

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/ids"

	"github.com/stretchr/testify/require"
)

// A decoded frame's body compares equal to its re-encoding: whitespace a
// peer put in is taken out, and a body with none is kept as it came.
func TestDecodedBodyIsCompact(t *testing.T) {
	for name, tc := range map[string]struct{ body, want string }{
		"spaced":            {`{ "requester" : "r",` + "\n\t" + `"items": [ ] }`, `{"requester":"r","items":[]}`},
		"compact":           {`{"requester":"r","items":[]}`, `{"requester":"r","items":[]}`},
		"a space in a text": {`{"err":"a b"}`, `{"err":"a b"}`},
		"null":              {`null`, ``},
	} {
		frame := []byte(fmt.Sprintf(`{"v":%d,"id":5,"op":%q,"body":%s}`, Version, OpReserveBatch, tc.body))
		req, err := DecodeRequest(frame)
		require.NoError(t, err, name)
		require.Equal(t, tc.want, string(req.Body), name)
	}
}

// BenchmarkDecodeReserveFrame256 decodes the frame of a reserve of 256
// items, as the shard does before it decodes the body.
func BenchmarkDecodeReserveFrame256(b *testing.B) {
	items := make([]ReserveItem, 256)
	for i := range items {
		items[i] = ReserveItem{TransferID: fmt.Sprintf("hp-7-%d", i), MMHash: fmt.Sprintf("%032x%032x", 7, i), NBytes: 65536, Meta: `{"dtype":"uint8","shape":[1,65536]}`}
	}
	body, err := json.Marshal(ReserveBatch{Requester: fmt.Sprintf("%032x", 1), Items: items})
	require.NoError(b, err)
	frame, err := EncodeRequest(Request{V: Version, ID: 9, Op: OpReserveBatch, Body: body})
	require.NoError(b, err)
	for b.Loop() {
		if _, err := DecodeRequest(frame); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReserveRoundTrip256 is every JSON step of one reserve of 256
// items: the producer encodes the request, the shard decodes its frame
// and body and encodes a reply of 256 write grants, and the producer
// decodes that reply's frame and body.
func BenchmarkReserveRoundTrip256(b *testing.B) {
	items := make([]ReserveItem, 256)
	grants := make([]Grant, 256)
	for i := range items {
		items[i] = ReserveItem{TransferID: fmt.Sprintf("hp-7-%d", i), MMHash: fmt.Sprintf("%032x%032x", 7, i), NBytes: 65536, Meta: `{"dtype":"uint8","shape":[1,65536]}`}
		grants[i] = Grant{TransferID: items[i].TransferID, Kind: KindWrite, Res: uint64(i + 1), Token: ids.Token{byte(i), 1, 2, 3}, NBytes: 65536, Addr: uint64(i) << 16}
	}
	in := ReserveBatch{Requester: fmt.Sprintf("%032x", 1), Items: items}
	for b.Loop() {
		req, err := NewRequest(9, OpReserveBatch, in)
		if err != nil {
			b.Fatal(err)
		}
		frame, err := EncodeRequest(req)
		if err != nil {
			b.Fatal(err)
		}
		got, err := DecodeRequest(frame)
		if err != nil {
			b.Fatal(err)
		}
		body, err := DecodeBody[ReserveBatch](got.Body)
		if err != nil || len(body.Items) != len(items) {
			b.Fatal(err, len(body.Items))
		}
		rframe, err := EncodeReply(OKReply(got.ID, ReserveBatchReply{Grants: grants, Epoch: "e1", Host: "h"}))
		if err != nil {
			b.Fatal(err)
		}
		rep, err := DecodeReply(rframe)
		if err != nil {
			b.Fatal(err)
		}
		out, err := DecodeBody[ReserveBatchReply](rep.Body)
		if err != nil || len(out.Grants) != len(grants) {
			b.Fatal(err, len(out.Grants))
		}
	}
}
