package ids

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"io"
)

// TokenLen is the size of a reservation token in bytes (128 bits).
const TokenLen = 16

// Token authorises writes into one reservation. The zero Token is never
// issued and never accepted.
type Token [TokenLen]byte

// TokenSource produces tokens. Production code uses crypto/rand; tests pass
// a deterministic reader so that state-machine runs replay exactly.
type TokenSource interface {
	NewToken() (Token, error)
}

// ReaderTokens draws tokens from an io.Reader.
type ReaderTokens struct{ R io.Reader }

// NewToken reads TokenLen bytes; it never returns the zero token.
func (s ReaderTokens) NewToken() (Token, error) {
	var t Token
	for {
		if _, err := io.ReadFull(s.R, t[:]); err != nil {
			return Token{}, fmt.Errorf("ids: read token: %w", err)
		}
		if !t.IsZero() {
			return t, nil
		}
	}
}

// CryptoTokens is the production token source.
var CryptoTokens TokenSource = ReaderTokens{R: rand.Reader}

// IsZero reports whether t is the zero token.
func (t Token) IsZero() bool { return t == Token{} }

// Equal compares in constant time so that a remote writer cannot learn a
// token byte by byte from rejection timing.
func (t Token) Equal(o Token) bool {
	return subtle.ConstantTimeCompare(t[:], o[:]) == 1
}

// String returns the token as 32 lowercase hex digits.
func (t Token) String() string { return hex.EncodeToString(t[:]) }

// MarshalText encodes the token as hex (used by the JSON control messages).
func (t Token) MarshalText() ([]byte, error) {
	out := make([]byte, hex.EncodedLen(TokenLen))
	hex.Encode(out, t[:])
	return out, nil
}

// UnmarshalText decodes 32 hex digits.
func (t *Token) UnmarshalText(b []byte) error {
	if len(b) != hex.EncodedLen(TokenLen) {
		return fmt.Errorf("ids: token must be %d hex digits, got %d bytes", hex.EncodedLen(TokenLen), len(b))
	}
	var v Token
	if _, err := hex.Decode(v[:], b); err != nil {
		return fmt.Errorf("ids: token: %w", err)
	}
	*t = v
	return nil
}

// ParseToken decodes a hex token.
func ParseToken(s string) (Token, error) {
	var t Token
	err := t.UnmarshalText([]byte(s))
	return t, err
}

// ResID names one reservation inside one consumer shard. Zero is never issued.
type ResID uint64

// Counter issues ResIDs in increasing order. It is not safe for concurrent
// use; its owner (a state machine) serialises access.
type Counter struct{ last ResID }

// Next returns the next unused id.
func (c *Counter) Next() ResID { c.last++; return c.last }
