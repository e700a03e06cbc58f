package cudaipc

import (
	"bytes"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
)

func TestHelloRoundTrips(t *testing.T) {
	nonce := [nonceLen]byte{1, 2, 3}
	got, err := readHello(bytes.NewReader(appendHello(nil, nonce)))
	require.NoError(t, err)
	require.Equal(t, nonce, got)

	h := hello{Nonce: nonce, Export: gpu.Export{Handle: gpu.IPCHandle{9, 8, 7}, Offset: 4096}, Base: 0x7f00_0000_1000, Size: 1 << 30, Ordinal: 3, Generation: 5, Slots: wordSlots}
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
	p := peerAddr{socket: socketPrefix + "12-ab", nonce: [nonceLen]byte{0xab, 1}}
	got, err := parseAddr(p.String())
	require.NoError(t, err)
	require.Equal(t, p, got)
	nonce := "?nonce=" + string(bytes.Repeat([]byte("a"), 32))
	for _, bad := range []string{"@" + socketPrefix + "1", "@" + socketPrefix + "1?nonce=ab", "127.0.0.1:4567" + nonce,
		socketPrefix + "1" + nonce, "@other-socket" + nonce, "@" + socketPrefix + "A" + nonce, "@" + socketPrefix + "1?nonce=" + string(bytes.Repeat([]byte("z"), 32))} {
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
		appendHelloReply(nil, helloReply{hello: hello{Size: 10, Base: 4096, Generation: 3, Slots: wordSlots}}),
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
	f.Add(peerAddr{socket: socketPrefix + "1-2", nonce: [nonceLen]byte{7}}.String())
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

func TestAnnounceRoundTrips(t *testing.T) {
	as := []announcement{{Res: 7, Token: ids.Token{1, 2}, Slot: 4095, Value: word(9, 1)}, {Res: 8, Slot: 0, Value: 1}}
	got, err := readAnnounce(bytes.NewReader(appendAnnounce(nil, as)))
	require.NoError(t, err)
	require.Equal(t, as, got)
}

func TestAnnounceDecoderRefusesGarbage(t *testing.T) {
	good := appendAnnounce(nil, []announcement{{Res: 7, Slot: 1, Value: 2}})
	for name, b := range map[string][]byte{
		"magic":          append([]byte("XXXX"), good[4:]...),
		"op":             append(append([]byte{}, good[:5]...), append([]byte{opHello}, good[6:]...)...),
		"no entries":     append(append([]byte{}, good[:6]...), append([]byte{0, 0}, good[8:]...)...),
		"too many":       append(append([]byte{}, good[:6]...), append([]byte{0xff, 0xff}, good[8:]...)...),
		"reserved":       append(append([]byte{}, good[:8]...), append([]byte{1}, good[9:]...)...),
		"entry reserved": append(append([]byte{}, good[:headerLen+28]...), append([]byte{1}, good[headerLen+29:]...)...),
		"truncated":      good[:len(good)-1],
		"header only":    good[:headerLen],
	} {
		_, err := readAnnounce(bytes.NewReader(b))
		require.ErrorIs(t, err, errBadMessage, name)
	}
}

// FuzzReadAnnounce: a producer's announcements are network bytes; the
// decoder is bounded (at most maxEntries entries, read before any is
// judged) and what it accepts encodes back the same.
func FuzzReadAnnounce(f *testing.F) {
	fuzzRoundTrip(f, readAnnounce, appendAnnounce,
		appendAnnounce(nil, []announcement{{Res: 1, Token: ids.Token{3}, Slot: 2, Value: word(1, 1)}}),
		appendAnnounce(nil, []announcement{{Res: 1}, {Res: 2, Slot: wordSlots}}))
}
