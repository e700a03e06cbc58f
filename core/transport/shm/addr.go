package shm

import (
	"encoding/hex"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
)

// peer is what a consumer shard publishes as its shm data-plane address:
// the abstract Unix socket that hands its slab's memfd to producers, the
// nonce a producer must present there, where the slab sits in the
// consumer (the base the grants' addresses are relative to), its size,
// and which host it is on. It names no file: a producer never opens a path
// that a peer chose.
type peer struct {
	Socket string // abstract socket name, without the leading '@'
	Nonce  [nonceLen]byte
	Base   uint64
	Len    uint64
	Host   string
}

const (
	scheme = "shm://@"
	// socketPrefix starts every socket name a producer connects to, so
	// that a peers reply cannot point it at another program's abstract
	// socket.
	socketPrefix = "ecmooncake-shm-"
	// maxSocket keeps the name, with its leading NUL, inside sun_path.
	maxSocket = 100
	nonceLen  = 16
)

func (p peer) String() string {
	q := url.Values{}
	q.Set("base", strconv.FormatUint(p.Base, 10))
	q.Set("len", strconv.FormatUint(p.Len, 10))
	q.Set("host", p.Host)
	q.Set("nonce", hex.EncodeToString(p.Nonce[:]))
	return scheme + p.Socket + "?" + q.Encode()
}

func parsePeer(s string) (peer, error) {
	bad := func(why string) (peer, error) {
		return peer{}, fmt.Errorf("shm: data-plane address %q: %s", s, why)
	}
	rest, ok := strings.CutPrefix(s, scheme)
	if !ok {
		return bad("does not start with " + scheme + " (an abstract socket name)")
	}
	name, query, _ := strings.Cut(rest, "?")
	if err := checkSocketName(name); err != nil {
		return bad(err.Error())
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return bad(err.Error())
	}
	p := peer{Socket: name, Host: q.Get("host")}
	if p.Base, err = strconv.ParseUint(q.Get("base"), 10, 64); err != nil || p.Base == 0 {
		return bad("base is not a non-zero address")
	}
	if p.Len, err = strconv.ParseUint(q.Get("len"), 10, 64); err != nil || p.Len == 0 || p.Base+p.Len < p.Base || p.Len > maxLen {
		return bad("len is not a positive size that fits after base")
	}
	// The length first: hex.Decode writes past a short destination.
	if nonce := q.Get("nonce"); len(nonce) != 2*nonceLen {
		return bad(fmt.Sprintf("nonce is not %d hex digits", 2*nonceLen))
	} else if n, err := hex.Decode(p.Nonce[:], []byte(nonce)); err != nil || n != nonceLen {
		return bad(fmt.Sprintf("nonce is not %d hex digits", 2*nonceLen))
	}
	if p.Host == "" {
		return bad("host is required")
	}
	return p, nil
}

// checkSocketName accepts only the names Listen makes: the project's
// prefix, then lower-case letters, digits and dashes.
func checkSocketName(name string) error {
	return unixfd.CheckSocketName(name, socketPrefix, maxSocket)
}

// maxLen keeps a mapping's length an int on every platform Go runs on.
const maxLen = 1 << 50
