package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
)

// The fd handshake, on a connection to the shard's abstract socket:
//
//	hello (producer → shard), helloLen bytes:
//	0  magic "ECMH"   4  version u8   5  reserved [3]   8  nonce [16]
//
//	grant (shard → producer), grantLen bytes, carrying exactly one file
//	descriptor (SCM_RIGHTS) when status is grantOK:
//	0  magic "ECMG"   4  version u8   5  status u8   6  reserved u16   8  slab bytes u64
//
// After a grant the shard keeps the connection open and sends nothing
// more; its end tells the producer that the shard is gone, so that it
// unmaps the slab instead of keeping its memory alive.
const (
	helloLen         = 24
	grantLen         = 16
	handshakeVersion = 1
	helloMagic       = "ECMH"
	grantMagic       = "ECMG"
)

// errBadHandshake is wrapped by every decoding error.
var errBadHandshake = errors.New("bad shm handshake message")

type hello struct{ Nonce [nonceLen]byte }

func appendHello(b []byte, h hello) []byte {
	b = append(b, helloMagic...)
	b = append(b, handshakeVersion, 0, 0, 0)
	return append(b, h.Nonce[:]...)
}

func decodeHello(b []byte) (hello, error) {
	var h hello
	if err := checkPreamble(b, "hello", helloMagic, helloLen, 5); err != nil {
		return h, err
	}
	copy(h.Nonce[:], b[8:])
	return h, nil
}

// checkPreamble checks what hello and grant share: their length n, and in
// their first 8 bytes the magic, the version and, from reserved on, zeros.
func checkPreamble(b []byte, what, magic string, n, reserved int) error {
	switch {
	case len(b) != n:
		return fmt.Errorf("%s of %d bytes, want %d: %w", what, len(b), n, errBadHandshake)
	case string(b[:4]) != magic:
		return fmt.Errorf("%s magic %q: %w", what, b[:4], errBadHandshake)
	case b[4] != handshakeVersion:
		return fmt.Errorf("%s version %d, want %d: %w", what, b[4], handshakeVersion, errBadHandshake)
	case strings.Trim(string(b[reserved:8]), "\x00") != "":
		return fmt.Errorf("%s reserved bytes not zero: %w", what, errBadHandshake)
	}
	return nil
}

type grantStatus uint8

const (
	grantOK grantStatus = iota
	// grantBadNonce: the hello's nonce is not the shard's (an address of
	// an earlier incarnation, or a guess).
	grantBadNonce
	// grantRefused: the shard does not serve this peer.
	grantRefused
)

var grantStatusNames = [...]string{grantOK: "ok", grantBadNonce: "bad nonce", grantRefused: "refused"}

func (s grantStatus) String() string {
	if int(s) < len(grantStatusNames) {
		return grantStatusNames[s]
	}
	return fmt.Sprintf("status %d", uint8(s))
}

type grant struct {
	Status grantStatus
	Len    uint64
}

func appendGrant(b []byte, g grant) []byte {
	b = append(b, grantMagic...)
	b = append(b, handshakeVersion, byte(g.Status), 0, 0)
	return binary.LittleEndian.AppendUint64(b, g.Len)
}

func decodeGrant(b []byte) (grant, error) {
	var g grant
	if err := checkPreamble(b, "grant", grantMagic, grantLen, 6); err != nil {
		return g, err
	}
	g.Status = grantStatus(b[5])
	g.Len = binary.LittleEndian.Uint64(b[8:])
	if g.Status == grantOK && (g.Len == 0 || g.Len > maxLen) {
		return g, fmt.Errorf("grant of a %d-byte slab: %w", g.Len, errBadHandshake)
	}
	return g, nil
}

// takeRights returns the single descriptor a grant carries (see
// unixfd.TakeRights); its errors are handshake errors.
func takeRights(oob []byte, flags int) (int, error) {
	fd, err := unixfd.TakeRights(oob, flags)
	if err != nil {
		return -1, fmt.Errorf("grant: %w: %w", err, errBadHandshake)
	}
	return fd, nil
}

// sameUser checks that c's peer runs as this process's uid.
func sameUser(c *net.UnixConn) error { return unixfd.SameUser(c) }
