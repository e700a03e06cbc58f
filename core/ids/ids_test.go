package ids

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTokenNeverZero(t *testing.T) {
	src := ReaderTokens{R: bytes.NewReader(append(make([]byte, TokenLen), bytes.Repeat([]byte{7}, TokenLen)...))}
	tok, err := src.NewToken()
	require.NoError(t, err)
	require.False(t, tok.IsZero(), "a zero token from the reader must be skipped")
	require.Equal(t, byte(7), tok[0])

	_, err = src.NewToken()
	require.Error(t, err, "an exhausted reader must fail, not loop")
}

func TestTokenTextRoundTrip(t *testing.T) {
	tok, err := CryptoTokens.NewToken()
	require.NoError(t, err)
	b, err := json.Marshal(struct{ T Token }{tok})
	require.NoError(t, err)
	var back struct{ T Token }
	require.NoError(t, json.Unmarshal(b, &back))
	require.True(t, tok.Equal(back.T))

	for _, bad := range []string{"", "zz", tok.String()[:30], tok.String() + "00", "g" + tok.String()[1:]} {
		_, err := ParseToken(bad)
		require.Error(t, err, "ParseToken(%q)", bad)
	}
}

func TestCounterMonotonic(t *testing.T) {
	var c Counter
	require.Equal(t, ResID(1), c.Next())
	require.Equal(t, ResID(2), c.Next())
}

func TestHostIdentity(t *testing.T) {
	require.Equal(t, "gpu-host-7", HostIdentity("gpu-host-7"), "a configured name wins")
	want, err := os.Hostname()
	if err != nil {
		want = "unknown"
	}
	require.Equal(t, want, HostIdentity(""))
	require.NotEmpty(t, HostIdentity(""))
}
