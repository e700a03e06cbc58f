package cudaipc

import (
	"bytes"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

func TestHelloRoundTrips(t *testing.T) {
	nonce := [nonceLen]byte{1, 2, 3}
	got, err := readHello(bytes.NewReader(appendHello(nil, nonce)))
	require.NoError(t, err)
	require.Equal(t, nonce, got)

	h := hello{Nonce: nonce, Export: gpu.Export{Handle: gpu.IPCHandle{9, 8, 7}, Offset: 4096}, Base: 0x7f00_0000_1000, Size: 1 << 30, Ordinal: 3}
	for _, want := range []helloReply{{hello: h}, {status: statusBadNonce, msg: "unknown nonce"}} {
		rep, err := readHelloReply(bytes.NewReader(appendHelloReply(nil, want)))
		require.NoError(t, err)
		require.Equal(t, want, rep)
	}
}

func TestHelloDecodersRefuseWhatTheyDoNotKnow(t *testing.T) {
	good := appendHello(nil, [nonceLen]byte{1})
	for name, mutate := range map[string]func([]byte){
		"magic":    func(b []byte) { b[0] = 'X' },
		"version":  func(b []byte) { b[4] = 1 },
		"op":       func(b []byte) { b[5] = 2 },
		"reserved": func(b []byte) { b[9] = 1 },
	} {
		b := bytes.Clone(good)
		mutate(b)
		_, err := readHello(bytes.NewReader(b))
		require.ErrorIs(t, err, errBadMessage, name)
	}
	_, err := readHello(bytes.NewReader(good[:20]))
	require.ErrorIs(t, err, errBadMessage, "truncated")
}

func TestAddrRoundTrips(t *testing.T) {
	p := peerAddr{hostPort: "127.0.0.1:4567", nonce: [nonceLen]byte{0xab, 1}}
	got, err := parseAddr(p.String())
	require.NoError(t, err)
	require.Equal(t, p, got)
	for _, bad := range []string{"127.0.0.1:4567", "127.0.0.1:4567?nonce=ab", "nohost?nonce=" + string(bytes.Repeat([]byte("a"), 32)), "h:1?nonce=" + string(bytes.Repeat([]byte("z"), 32))} {
		_, err := parseAddr(bad)
		require.Error(t, err, bad)
	}
}

func FuzzReadHello(f *testing.F) {
	fuzzRoundTrip(f, readHello, appendHello, appendHello(nil, [nonceLen]byte{1}))
}

func FuzzReadHelloReply(f *testing.F) {
	fuzzRoundTrip(f, readHelloReply, appendHelloReply,
		appendHelloReply(nil, helloReply{hello: hello{Size: 10, Base: 4096}}),
		appendHelloReply(nil, helloReply{status: statusBadNonce, msg: "no"}))
}

// fuzzRoundTrip fuzzes read from seeds on: what it accepts, encode writes
// back as bytes that read the same.
func fuzzRoundTrip[T any](f *testing.F, read func(io.Reader) (T, error), encode func([]byte, T) []byte, seeds ...[]byte) {
	for _, s := range seeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := read(bytes.NewReader(b))
		if err != nil {
			return
		}
		again, err := read(bytes.NewReader(encode(nil, v)))
		require.NoError(t, err)
		require.Equal(t, v, again)
	})
}

func FuzzParseAddr(f *testing.F) {
	f.Add(peerAddr{hostPort: "127.0.0.1:1", nonce: [nonceLen]byte{7}}.String())
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parseAddr(s)
		if err != nil {
			return
		}
		again, err := parseAddr(p.String())
		require.NoError(t, err)
		require.Equal(t, p, again)
	})
}
