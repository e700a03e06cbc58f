package wire

import (
	"encoding/json"
	"fmt"
	"testing"

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
