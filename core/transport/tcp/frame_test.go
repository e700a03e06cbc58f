package tcp

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
)

func sampleHeader() Header {
	return Header{Seq: 7, Res: 42, Token: ids.Token{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, Offset: 1 << 33, Length: MaxFrame}
}

func TestHeaderRoundTrip(t *testing.T) {
	h := sampleHeader()
	b := AppendHeader(nil, h)
	require.Len(t, b, HeaderLen)
	require.Equal(t, "ECMW", string(b[:4]))
	got, err := DecodeHeader(b)
	require.NoError(t, err)
	require.Equal(t, h, got)
}

// A frame that carries its item's completion says so in its flags, and
// only that flag is taken.
func TestHeaderCompleteFlag(t *testing.T) {
	h := sampleHeader()
	h.Complete = true
	b := AppendHeader(nil, h)
	require.Equal(t, byte(FlagComplete), b[5])
	got, err := DecodeHeader(b)
	require.NoError(t, err)
	require.Equal(t, h, got)
	b[5] |= 2
	_, err = DecodeHeader(b)
	require.ErrorIs(t, err, transport.ErrBadFrame, "a flag beside FlagComplete")
}

func TestDecodeHeaderRefuses(t *testing.T) {
	good := AppendHeader(nil, sampleHeader())
	with := func(f func(b []byte)) []byte { return mutated(good, f) }
	requireRefuses(t, DecodeHeader, []refusal{
		{"empty", nil, "0 of 56 bytes"},
		{"short", good[:HeaderLen-1], "55 of 56 bytes"},
		{"bad magic", with(func(b []byte) { b[0] = 'X' }), "magic"},
		{"ack magic", with(func(b []byte) { copy(b, ackMagic) }), "magic"},
		{"version 0", with(func(b []byte) { b[4] = 0 }), "version 0"},
		{"version 2", with(func(b []byte) { b[4] = 2 }), "version 2"},
		{"flag bit", with(func(b []byte) { b[5] = 0x80 }), "flags"},
		{"reserved low", with(func(b []byte) { b[6] = 1 }), "reserved"},
		{"reserved high", with(func(b []byte) { b[7] = 1 }), "reserved"},
		{"length over MaxFrame", with(func(b []byte) { binary.LittleEndian.PutUint64(b[48:], MaxFrame+1) }), "length"},
		{"length huge", with(func(b []byte) { binary.LittleEndian.PutUint64(b[48:], ^uint64(0)) }), "length"},
	})
}

// mutated is a copy of b changed by f.
func mutated(b []byte, f func(b []byte)) []byte {
	b = bytes.Clone(b)
	f(b)
	return b
}

// refusal is bytes a decoder must refuse with ErrBadFrame, and what the
// error must say.
type refusal struct {
	name string
	b    []byte
	want string
}

func requireRefuses[T any](t *testing.T, decode func([]byte) (T, error), cases []refusal) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := decode(c.b)
			require.ErrorIs(t, err, transport.ErrBadFrame)
			require.Contains(t, err.Error(), c.want)
		})
	}
}

func TestAckRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		a    Ack
		want Ack
	}{
		{"ok", Ack{Seq: 1, Status: transport.StatusOK}, Ack{Seq: 1, Status: transport.StatusOK}},
		{"refusal with message", Ack{Seq: 1 << 60, Status: transport.StatusGone, Msg: "res 3 gone"}, Ack{Seq: 1 << 60, Status: transport.StatusGone, Msg: "res 3 gone"}},
		{"long message truncated", Ack{Seq: 2, Status: transport.StatusOther, Msg: strings.Repeat("x", MaxAckMsg+10)}, Ack{Seq: 2, Status: transport.StatusOther, Msg: strings.Repeat("x", MaxAckMsg)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := AppendAck(nil, c.a)
			require.Len(t, b, AckHeaderLen+len(c.want.Msg))
			got, err := DecodeAck(b)
			require.NoError(t, err)
			require.Equal(t, c.want, got)
		})
	}
}

func TestDecodeAckRefuses(t *testing.T) {
	good := AppendAck(nil, Ack{Seq: 9, Status: transport.StatusBadToken, Msg: "nope"})
	long := AppendAck(nil, Ack{Seq: 9})
	binary.LittleEndian.PutUint16(long[14:], MaxAckMsg+1)
	long = append(long, make([]byte, MaxAckMsg+1)...)
	requireRefuses(t, DecodeAck, []refusal{
		{"empty", nil, "0 of 16 bytes"},
		{"short head", good[:AckHeaderLen-1], "15 of 16"},
		{"short message", good[:len(good)-1], "message 3 of 4"},
		{"frame magic", append([]byte(frameMagic), good[4:]...), "magic"},
		{"message length over max", long, "message length"},
	})
}

func FuzzDecodeHeader(f *testing.F) {
	f.Add(AppendHeader(nil, sampleHeader()))
	f.Add(AppendHeader(nil, Header{}))
	f.Add(AppendHeader(nil, Header{Seq: 1, Res: 2, Length: 3, Complete: true}))
	f.Add([]byte("ECMW"))
	f.Add(bytes.Repeat([]byte{0xff}, HeaderLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := DecodeHeader(b)
		if err != nil {
			require.ErrorIs(t, err, transport.ErrBadFrame)
			return
		}
		require.LessOrEqual(t, h.Length, uint64(MaxFrame))
		require.Equal(t, b[:HeaderLen], AppendHeader(nil, h), "a valid header re-encodes to its input")
	})
}

func FuzzDecodeAck(f *testing.F) {
	f.Add(AppendAck(nil, Ack{Seq: 1, Status: transport.StatusOK}))
	f.Add(AppendAck(nil, Ack{Seq: 3, Status: transport.StatusBadToken, Msg: "bad token"}))
	f.Add([]byte("ECMA\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xff\xff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := DecodeAck(b)
		if err != nil {
			require.ErrorIs(t, err, transport.ErrBadFrame)
			return
		}
		require.LessOrEqual(t, len(a.Msg), MaxAckMsg)
		enc := AppendAck(nil, a)
		require.Equal(t, b[:len(enc)], enc, "a valid ack re-encodes to its input")
	})
}

func TestHandshakeRoundTrip(t *testing.T) {
	c := Challenge{Mode: ModeSecret, Nonce: [16]byte{1, 2, 3}}
	b := AppendChallenge(nil, c)
	require.Len(t, b, ChallengeLen)
	got, err := DecodeChallenge(b)
	require.NoError(t, err)
	require.Equal(t, c, got)
	p := Preamble{Mode: ModeSecret, MAC: prove(proofKey(testSecret), b)}
	pb := AppendPreamble(nil, p)
	require.Len(t, pb, PreambleLen)
	gotP, err := DecodePreamble(pb)
	require.NoError(t, err)
	require.Equal(t, p, gotP)
	b[8] ^= 1
	require.NotEqual(t, p.MAC, prove(proofKey(testSecret), b), "the proof covers the nonce")
	_, err = DecodePreamble(AppendHeader(nil, sampleHeader()))
	require.ErrorContains(t, err, "without a handshake")
}

func FuzzDecodePreamble(f *testing.F) {
	f.Add(AppendPreamble(nil, Preamble{Mode: ModeSecret, MAC: [32]byte{7}}))
	f.Add(AppendPreamble(nil, Preamble{Mode: ModeGrant}))
	f.Add(AppendHeader(nil, sampleHeader()))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := DecodePreamble(b)
		if err != nil {
			require.ErrorIs(t, err, transport.ErrBadFrame)
			return
		}
		require.Equal(t, b[:PreambleLen], AppendPreamble(nil, p), "a valid preamble re-encodes to its input")
	})
}

func FuzzDecodeChallenge(f *testing.F) {
	f.Add(AppendChallenge(nil, Challenge{Mode: ModeGrant, Nonce: [16]byte{9}}))
	f.Add([]byte("ECMC\x02\x03\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := DecodeChallenge(b)
		if err != nil {
			require.ErrorIs(t, err, transport.ErrBadFrame)
			return
		}
		require.Equal(t, b[:ChallengeLen], AppendChallenge(nil, c), "a valid challenge re-encodes to its input")
	})
}
