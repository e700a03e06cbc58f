package shm

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"
)

// Every decoder of bytes a peer chose: the peers address, the handshake
// messages and their control data, and /proc/self/maps fields.

func FuzzParsePeer(f *testing.F) {
	f.Add(peer{Socket: "ecmooncake-shm-1-ab", Base: 4096, Len: 4096, Host: "h", Nonce: [16]byte{1}}.String())
	f.Add("shm:///dev/shm/x?base=1&len=1&host=h&ino=1&epoch=e")
	f.Add("shm://@ecmooncake-shm-x?base=1&len=1&host=h&nonce=00000000000000000000000000000000")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parsePeer(s)
		if err != nil {
			return
		}
		if checkSocketName(p.Socket) != nil || p.Base == 0 || p.Len == 0 || p.Base+p.Len < p.Base || p.Len > maxLen || p.Host == "" {
			t.Fatalf("parsePeer(%q) accepted %+v", s, p)
		}
		again, err := parsePeer(p.String())
		if err != nil || again != p {
			t.Fatalf("round trip of %+v: %+v, %v", p, again, err)
		}
	})
}

func FuzzDecodeHello(f *testing.F) {
	f.Add(appendHello(nil, hello{Nonce: [16]byte{9, 8}}))
	f.Add([]byte("ECMH"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			return
		}
		if !bytes.Equal(appendHello(nil, h), b) {
			t.Fatalf("decodeHello(%x) = %+v, which encodes differently", b, h)
		}
	})
}

func FuzzDecodeGrant(f *testing.F) {
	f.Add(appendGrant(nil, grant{Status: grantOK, Len: 1 << 20}))
	f.Add(appendGrant(nil, grant{Status: grantBadNonce}))
	f.Fuzz(func(t *testing.T, b []byte) {
		g, err := decodeGrant(b)
		if err != nil {
			return
		}
		if g.Status == grantOK && (g.Len == 0 || g.Len > maxLen) {
			t.Fatalf("decodeGrant(%x) accepted a %d-byte slab", b, g.Len)
		}
		if !bytes.Equal(appendGrant(nil, g), b) {
			t.Fatalf("decodeGrant(%x) = %+v, which encodes differently", b, g)
		}
	})
}

// FuzzParseRange and FuzzParseDev read /proc/self/maps fields: what they
// accept is hex the way the kernel prints it, and reads back the same.
func FuzzParseRange(f *testing.F) {
	f.Add("7f0000000000-7f0000100000")
	f.Add("ffffffffffffffff-0")
	f.Add("-")
	f.Fuzz(func(t *testing.T, rng string) {
		if lo, hi, ok := checkHexPair(t, "parseRange", parseRange, rng, "-", math.MaxUint64); ok && lo > hi {
			t.Fatalf("parseRange(%q) = [%#x, %#x)", rng, lo, hi)
		}
	})
}

func FuzzParseDev(f *testing.F) {
	f.Add("00:01")
	f.Add("fd:1ff")
	f.Fuzz(func(t *testing.T, dev string) {
		checkHexPair(t, "parseDev", parseDev, dev, ":", math.MaxUint32)
	})
}

// checkHexPair checks that what parse accepts of s is two hex numbers of
// at most max around one sep, and that they read back the same.
func checkHexPair(t *testing.T, name string, parse func(string) (uint64, uint64, bool), s, sep string, max uint64) (a, b uint64, ok bool) {
	a, b, ok = parse(s)
	if !ok {
		return a, b, false
	}
	if a > max || b > max || strings.Count(s, sep) != 1 || strings.Trim(s, "0123456789abcdefABCDEF"+sep) != "" {
		t.Fatalf("%s(%q) = %#x%s%#x", name, s, a, sep, b)
	}
	again := fmt.Sprintf("%x%s%x", a, sep, b)
	if a2, b2, ok2 := parse(again); !ok2 || a2 != a || b2 != b {
		t.Fatalf("%s(%q) = %#x%s%#x, which reads back as %#x%s%#x %v", name, s, a, sep, b, a2, sep, b2, ok2)
	}
	return a, b, true
}
