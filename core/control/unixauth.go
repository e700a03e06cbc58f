package control

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"github.com/ecmooncake/ecmooncake/core/internal/peercred"
)

// A Unix control connection is admitted twice before its first request:
// by the kernel, which names the uid of the process at each end
// (SO_PEERCRED, checked by both ends: a server must not serve another
// user, a client must not trust a name another user squatted), and, when
// the deployment has a secret, by a challenge–response that proves both
// ends hold it without putting it on the wire:
//
//	server → client, hello (unixHelloLen bytes):
//	0  magic "ECUH"   4  version u8   5  mode u8   6  reserved u16
//	8  server nonce [16]byte
//
//	client → server, answer (unixAnswerLen bytes):
//	0  magic "ECUR"   4  version u8   5  mode u8   6  reserved u16
//	8  mac [32]byte = HMAC(key, "client" ‖ hello)   40  client nonce [16]byte
//
//	server → client, verdict (unixVerdictLen bytes):
//	0  magic "ECUV"   4  version u8   5  status u8  6  reserved u16
//	8  mac [32]byte = HMAC(key, "server" ‖ hello ‖ client nonce)
//
// Mode 1 is no secret (macs zero), mode 2 a secret; the key is derived
// from the deployment's CURVE keys, so it shares no key with CURVE itself
// nor with the data plane. Both nonces are fresh per connection: a
// recorded answer or verdict proves nothing on another.
const (
	unixHelloLen    = 24
	unixAnswerLen   = 56
	unixVerdictLen  = 40
	unixAuthVersion = 1
	unixModeNone    = 1
	unixModeSecret  = 2
	unixNonceLen    = 16
	unixKDFInfo     = "unix control proof v1"
)

// Verdict statuses; anything but unixAdmitted names a refusal.
const (
	unixAdmitted byte = iota
	unixRefusedNoSecret
	unixRefusedUnexpectedSecret
	unixRefusedWrongSecret
	unixRefusedUID
	unixRefusedBusy
)

// unixEarlyRefusal is what a server sends in place of its hello to a
// connection it will not admit at all (another uid, over the cap): the
// first unixHelloLen bytes of a verdict, so that the client can say why.
func unixEarlyRefusal(status byte) []byte {
	return unixOpening("ECUV", status, make([]byte, unixHelloLen-8))
}

// Refusals of the Unix path (ServerStats.Refused, ecm_failures_total)
// beside those security.go names for CURVE.
const (
	// The peer runs as another user (SO_PEERCRED), and is not root.
	refusedUnixUID refusal = "unix_uid"
	// A connection beyond the cap of concurrent connections.
	refusedUnixConnCap refusal = "unix_conn_cap"
	// A connection beyond its uid's share of that cap.
	refusedUnixUIDCap refusal = "unix_uid_cap"
	// A handshake that was not ours, or not done by its deadline.
	refusedUnixHandshake refusal = "unix_handshake"
)

var errUnixHandshake = errors.New("bad unix control handshake")

// unixKey derives the proof key of a secured Security; nil without one.
func unixKey(sec Security) []byte {
	if sec.keys == nil {
		return nil
	}
	ikm := sec.keys.ServerSecret + sec.keys.ClientSecret
	k, err := hkdf.Key(sha256.New, []byte(ikm), []byte(kdfSalt), unixKDFInfo, sha256.Size)
	if err != nil {
		// HKDF-SHA256 of 32 bytes cannot fail; a nil key would refuse all.
		return nil
	}
	return k
}

func unixMode(key []byte) byte {
	if key == nil {
		return unixModeNone
	}
	return unixModeSecret
}

func unixMAC(key []byte, label string, parts ...[]byte) []byte {
	if key == nil {
		return make([]byte, sha256.Size)
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(label))
	for _, p := range parts {
		m.Write(p)
	}
	return m.Sum(nil)
}

func unixOpening(magic string, b1 byte, tail []byte) []byte {
	b := append([]byte(magic), unixAuthVersion, b1, 0, 0)
	return append(b, tail...)
}

// checkOpening checks magic, version and reserved bytes of a handshake
// message, returning its fifth byte (mode or status).
func checkOpening(what, magic string, b []byte) (byte, error) {
	if string(b[:4]) != magic {
		return 0, fmt.Errorf("control: unix %s: magic %q: %w", what, b[:4], errUnixHandshake)
	}
	if b[4] != unixAuthVersion {
		return 0, fmt.Errorf("control: unix %s: version %d, want %d: %w", what, b[4], unixAuthVersion, errUnixHandshake)
	}
	if b[6] != 0 || b[7] != 0 {
		return 0, fmt.Errorf("control: unix %s: reserved bytes not zero: %w", what, errUnixHandshake)
	}
	return b[5], nil
}

// sameUser admits our own uid and root's.
func sameUser(uid uint32) bool { return uid == uint32(os.Getuid()) || uid == 0 }

// admitUID applies the uid rule of a connection; a refusal names its uid.
func admitUID(c *net.UnixConn, allowed func(uint32) bool) error {
	uid, err := peercred.UID(c)
	if err != nil {
		return fmt.Errorf("control: unix peer credentials: %w", err)
	}
	if !allowed(uid) {
		return fmt.Errorf("control: unix peer runs as uid %d, this process as uid %d: %w", uid, os.Getuid(), ErrAuth)
	}
	return nil
}

// serverHandshake admits the client at the other end of c, whose uid the
// gate admitted at accept (unixgate.go), or says why not (a refusal label
// and an error). The caller sets the deadline.
func serverHandshake(c *net.UnixConn, key []byte) (refusal, error) {
	var nonce [unixNonceLen]byte
	_, _ = rand.Read(nonce[:])
	mode := unixMode(key)
	hello := unixOpening("ECUH", mode, nonce[:])
	if _, err := c.Write(hello); err != nil {
		return refusedUnixHandshake, fmt.Errorf("control: unix hello: %w", err)
	}
	ans := make([]byte, unixAnswerLen)
	if _, err := io.ReadFull(c, ans); err != nil {
		return refusedUnixHandshake, fmt.Errorf("control: unix answer: %w", err)
	}
	theirs, err := checkOpening("answer", "ECUR", ans)
	if err != nil {
		return refusedUnixHandshake, err
	}
	status, why := unixAdmitted, refusal("")
	switch {
	case theirs != unixModeNone && theirs != unixModeSecret:
		return refusedUnixHandshake, fmt.Errorf("control: unix answer: unknown mode %d: %w", theirs, errUnixHandshake)
	case mode == unixModeSecret && theirs == unixModeNone:
		status, why = unixRefusedNoSecret, refusedNoSecret
	case mode == unixModeNone && theirs == unixModeSecret:
		status, why = unixRefusedUnexpectedSecret, refusedUnexpectedSecret
	case !hmac.Equal(ans[8:40], unixMAC(key, "client", hello)):
		status, why = unixRefusedWrongSecret, refusedWrongSecret
	}
	verdict := unixOpening("ECUV", status, unixMAC(key, "server", hello, ans[40:]))
	if status != unixAdmitted {
		// No proof for a client that gave none.
		verdict = unixOpening("ECUV", status, make([]byte, sha256.Size))
	}
	if _, err := c.Write(verdict); err != nil && status == unixAdmitted {
		return refusedUnixHandshake, fmt.Errorf("control: unix verdict: %w", err)
	}
	if status != unixAdmitted {
		return why, fmt.Errorf("control: unix client refused: %s: %w", why, ErrAuth)
	}
	return "", nil
}

// clientHandshake proves this end to the server at the other end of c and
// checks the server's proof. The caller sets the deadline.
func clientHandshake(c *net.UnixConn, key []byte, allowed func(uint32) bool) error {
	if err := admitUID(c, allowed); err != nil {
		return err
	}
	hello := make([]byte, unixHelloLen)
	if _, err := io.ReadFull(c, hello); err != nil {
		return fmt.Errorf("control: unix hello: %w", err)
	}
	if string(hello[:4]) == "ECUV" {
		status, err := checkOpening("refusal", "ECUV", hello)
		if err != nil {
			return err
		}
		return unixVerdictErr(status)
	}
	if _, err := checkOpening("hello", "ECUH", hello); err != nil {
		return err
	}
	var nonce [unixNonceLen]byte
	_, _ = rand.Read(nonce[:])
	ans := unixOpening("ECUR", unixMode(key), append(unixMAC(key, "client", hello), nonce[:]...))
	if _, err := c.Write(ans); err != nil {
		return fmt.Errorf("control: unix answer: %w", err)
	}
	v := make([]byte, unixVerdictLen)
	if _, err := io.ReadFull(c, v); err != nil {
		return fmt.Errorf("control: unix verdict: %w", err)
	}
	status, err := checkOpening("verdict", "ECUV", v)
	if err != nil {
		return err
	}
	if status != unixAdmitted {
		return unixVerdictErr(status)
	}
	if !hmac.Equal(v[8:40], unixMAC(key, "server", hello, nonce[:])) {
		// Admitted by a server that cannot prove the secret: not ours.
		return fmt.Errorf("control: unix server's proof does not match this deployment's auth_secret: %w", ErrAuth)
	}
	return nil
}

// unixVerdictErr says why a server refused this end.
func unixVerdictErr(status byte) error {
	switch status {
	case unixRefusedNoSecret:
		return fmt.Errorf("control: unix server requires auth_secret and this end has none: %w", ErrAuth)
	case unixRefusedUnexpectedSecret:
		return fmt.Errorf("control: unix server has no auth_secret and this end has one: %w", ErrAuth)
	case unixRefusedWrongSecret:
		return fmt.Errorf("control: unix server holds another auth_secret: %w", ErrAuth)
	case unixRefusedUID:
		return fmt.Errorf("control: unix server serves another user (SO_PEERCRED): %w", ErrAuth)
	case unixRefusedBusy:
		return fmt.Errorf("control: unix server holds its cap of connections: %w", errUnixBusy)
	}
	return fmt.Errorf("control: unix verdict: unknown status %d: %w", status, errUnixHandshake)
}

// errUnixBusy: the server is at its cap of connections.
var errUnixBusy = errors.New("unix server busy")
