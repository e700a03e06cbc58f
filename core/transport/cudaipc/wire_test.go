package cudaipc

import (
	"bufio"
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

func TestRequestsRoundTrip(t *testing.T) {
	cases := []request{
		{Op: opHello},
		{Op: opBegin, Begin: []frameReq{{Res: 1, Token: ids.Token{1, 2}, Off: 3, N: 4}, {Res: 1 << 60, N: 1 << 40}}},
		{Op: opEnd, End: []endReq{{Frame: 9, OK: true}, {Frame: 10}}},
	}
	for _, want := range cases {
		t.Run(want.Op.String(), func(t *testing.T) {
			got, err := readRequest(bufio.NewReader(bytes.NewReader(appendRequest(nil, want))))
			require.NoError(t, err)
			if want.Op == opBegin {
				require.Equal(t, want.Begin, got.Begin)
			}
			require.Equal(t, want, normalize(got, want))
		})
	}
}

// normalize lets an empty decoded list equal a nil one.
func normalize(got, want request) request {
	if len(got.Begin) == 0 && want.Begin == nil {
		got.Begin = nil
	}
	if len(got.End) == 0 && want.End == nil {
		got.End = nil
	}
	return got
}

func TestRepliesRoundTrip(t *testing.T) {
	h := hello{Instance: [16]byte{1, 2, 3}, Export: gpu.Export{Handle: gpu.IPCHandle{9, 8, 7}, Offset: 4096}, Size: 1 << 30, Ordinal: 3}
	cases := []reply{
		{Op: opHello, Hello: h},
		{Op: opBegin, Grants: []grant{{Frame: 1, At: 256}, {Status: transport.StatusBadToken, Msg: "bad token"}}},
		{Op: opEnd},
		{Op: opBegin, Status: 1, Msg: "refused as a whole"},
	}
	for _, want := range cases {
		got, err := readReply(bufio.NewReader(bytes.NewReader(appendReply(nil, want))))
		require.NoError(t, err)
		if len(got.Grants) == 0 {
			got.Grants = nil
		}
		require.Equal(t, want, got)
	}
}

func TestBadMessagesAreRefused(t *testing.T) {
	valid := appendRequest(nil, request{Op: opBegin, Begin: []frameReq{{Res: 1, N: 1}}})
	cases := map[string][]byte{
		"bad magic":       append([]byte("XXXX"), valid[4:]...),
		"bad version":     append(append([]byte{}, valid[:4]...), append([]byte{9}, valid[5:]...)...),
		"unknown op":      append(append([]byte{}, valid[:5]...), append([]byte{42}, valid[6:]...)...),
		"too many":        appendHeader(nil, reqMagic, opBegin, 0, maxEntries+1, 0),
		"truncated entry": valid[:len(valid)-1],
		"hello with body": appendHeader(nil, reqMagic, opHello, 0, 1, 0),
		"reserved bits":   appendHeader(nil, reqMagic, opHello, 1, 0, 0),
		"ok byte":         append(appendHeader(nil, reqMagic, opEnd, 0, 1, 0), 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0),
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := readRequest(bufio.NewReader(bytes.NewReader(b)))
			require.ErrorIs(t, err, errBadMessage)
		})
	}
	long := appendHeader(nil, replyMagic, opEnd, 1, 0, maxMsg+1)
	_, err := readReply(bufio.NewReader(bytes.NewReader(long)))
	require.ErrorIs(t, err, errBadMessage)
}

func FuzzReadRequest(f *testing.F) {
	f.Add(appendRequest(nil, request{Op: opHello}))
	f.Add(appendRequest(nil, request{Op: opBegin, Begin: []frameReq{{Res: 1, N: 5}}}))
	f.Add(appendRequest(nil, request{Op: opEnd, End: []endReq{{Frame: 2, OK: true}}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := readRequest(bufio.NewReader(bytes.NewReader(b)))
		if err != nil {
			return
		}
		// What decodes re-encodes to the bytes it came from.
		enc := appendRequest(nil, req)
		require.Equal(t, b[:len(enc)], enc)
	})
}

func FuzzReadReply(f *testing.F) {
	f.Add(appendReply(nil, reply{Op: opHello, Hello: hello{Size: 10}}))
	f.Add(appendReply(nil, reply{Op: opBegin, Grants: []grant{{Frame: 1, At: 2, Status: 3, Msg: "x"}}}))
	f.Add(appendReply(nil, reply{Op: opEnd, Status: 1, Msg: "no"}))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = readReply(bufio.NewReader(bytes.NewReader(b)))
	})
}
