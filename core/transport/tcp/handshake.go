package tcp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Data protocol v2 opens every connection with a handshake, so that a
// connection proves itself before it holds one of the receiver's slots:
//
//	receiver → writer, a challenge (ChallengeLen bytes):
//	0  magic "ECMC"   4  version u8   5  mode u8   6  reserved u16
//	8  nonce [16]byte
//
//	writer → receiver, a preamble (PreambleLen bytes):
//	0  magic "ECMP"   4  version u8   5  mode u8   6  reserved u16
//	8  mac [32]byte
//
// In ModeSecret the mac is HMAC-SHA256 over the whole challenge, keyed by
// a key derived from the deployment secret: the nonce is fresh for every
// connection, so a preamble recorded on one connection proves nothing on
// another. In ModeGrant (no secret configured) the mac is zero and the
// connection proves itself with its first frame: a header the sink
// accepts, i.e. the write token of a live grant. Frames follow the
// preamble at once, without waiting for an answer; a receiver that refuses
// the proof says why in an ack with Seq 0 and StatusNotAdmitted.
const (
	ChallengeLen     = 24
	PreambleLen      = 40
	HandshakeVersion = 2
	nonceLen         = 16
	macLen           = sha256.Size
)

// Mode is how a data connection proves itself.
type Mode uint8

const (
	// ModeGrant: no deployment secret; the first frame must carry the
	// write token of a live grant.
	ModeGrant Mode = 1
	// ModeSecret: the preamble carries a MAC of the challenge keyed by the
	// deployment secret.
	ModeSecret Mode = 2
)

func (m Mode) String() string {
	switch m {
	case ModeGrant:
		return "grant"
	case ModeSecret:
		return "secret"
	}
	return fmt.Sprintf("mode_%d", uint8(m))
}

const (
	challengeMagic = "ECMC"
	preambleMagic  = "ECMP"
)

// Challenge is a receiver's opening: the proof it asks for and the nonce
// the proof must cover.
type Challenge struct {
	Mode  Mode
	Nonce [nonceLen]byte
}

// Preamble is a writer's answer to a challenge.
type Preamble struct {
	Mode Mode
	MAC  [macLen]byte
}

// AppendChallenge appends c's wire form to b.
func AppendChallenge(b []byte, c Challenge) []byte {
	b = append(b, challengeMagic...)
	b = append(b, HandshakeVersion, byte(c.Mode), 0, 0)
	return append(b, c.Nonce[:]...)
}

// AppendPreamble appends p's wire form to b.
func AppendPreamble(b []byte, p Preamble) []byte {
	b = append(b, preambleMagic...)
	b = append(b, HandshakeVersion, byte(p.Mode), 0, 0)
	return append(b, p.MAC[:]...)
}

// DecodeChallenge decodes the challenge at the start of b. Every error
// wraps ErrBadFrame.
func DecodeChallenge(b []byte) (Challenge, error) {
	m, err := decodeOpening("challenge", challengeMagic, b, ChallengeLen)
	if err != nil {
		return Challenge{}, err
	}
	c := Challenge{Mode: m}
	copy(c.Nonce[:], b[8:ChallengeLen])
	return c, nil
}

// DecodePreamble decodes the preamble at the start of b. Every error
// wraps ErrBadFrame; one that names a v1 frame header says the peer
// predates the handshake.
func DecodePreamble(b []byte) (Preamble, error) {
	m, err := decodeOpening("preamble", preambleMagic, b, PreambleLen)
	if err != nil {
		return Preamble{}, err
	}
	p := Preamble{Mode: m}
	copy(p.MAC[:], b[8:PreambleLen])
	if m == ModeGrant && p.MAC != ([macLen]byte{}) {
		return Preamble{}, fmt.Errorf("transport: preamble: grant mode with a mac: %w", transport.ErrBadFrame)
	}
	return p, nil
}

func decodeOpening(what, magic string, b []byte, n int) (Mode, error) {
	if len(b) < n {
		return 0, fmt.Errorf("transport: %s: %d of %d bytes: %w", what, len(b), n, transport.ErrBadFrame)
	}
	if string(b[:4]) != magic {
		if string(b[:4]) == frameMagic {
			return 0, fmt.Errorf("transport: %s: the peer sent a data frame without a handshake: it speaks data protocol v%d, this side v%d (upgrade it): %w",
				what, b[4], HandshakeVersion, transport.ErrBadFrame)
		}
		return 0, fmt.Errorf("transport: %s: magic %q: %w", what, b[:4], transport.ErrBadFrame)
	}
	if b[4] != HandshakeVersion {
		return 0, fmt.Errorf("transport: %s: version %d, want %d: %w", what, b[4], HandshakeVersion, transport.ErrBadFrame)
	}
	if b[6] != 0 || b[7] != 0 {
		return 0, fmt.Errorf("transport: %s: reserved %#x%02x not zero: %w", what, b[7], b[6], transport.ErrBadFrame)
	}
	m := Mode(b[5])
	if m != ModeGrant && m != ModeSecret {
		return 0, fmt.Errorf("transport: %s: unknown mode %d: %w", what, b[5], transport.ErrBadFrame)
	}
	return m, nil
}

// proofKey derives the data plane's key from the deployment secret, so
// that it shares no key with the control plane's CURVE keys derived from
// the same secret.
func proofKey(secret Secret) []byte {
	if secret == "" {
		return nil
	}
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte("ecmooncake data plane admission key v2"))
	return m.Sum(nil)
}

// prove is the mac a writer holding key sends for challenge (its wire
// form).
func prove(key, challenge []byte) [macLen]byte {
	m := hmac.New(sha256.New, key)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(challenge)))
	m.Write([]byte("ecmooncake data proof v2"))
	m.Write(n[:])
	m.Write(challenge)
	var out [macLen]byte
	copy(out[:], m.Sum(nil))
	return out
}

// Secret is the deployment secret as the data plane holds it: the
// settings' own type, which prints as a placeholder, so that a config
// logged with %v or %#v never shows it.
type Secret = config.Secret
