package shm

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// peer is what a consumer shard publishes as its shm data-plane address:
// which file to map, where its slab sits in the consumer (the base the
// grants' addresses are relative to), which host it is on, and which
// incarnation of the shard this is. On the wire the path is written as it
// is, each of its components escaped.
type peer struct {
	Path  string
	Base  uint64
	Len   uint64
	Host  string
	Ino   uint64
	Epoch string
}

const scheme = "shm://"

func (p peer) String() string {
	q := url.Values{}
	q.Set("base", strconv.FormatUint(p.Base, 10))
	q.Set("len", strconv.FormatUint(p.Len, 10))
	q.Set("host", p.Host)
	q.Set("ino", strconv.FormatUint(p.Ino, 10))
	q.Set("epoch", p.Epoch)
	segs := strings.Split(p.Path, "/")
	for i, seg := range segs {
		segs[i] = url.PathEscape(seg)
	}
	return scheme + strings.Join(segs, "/") + "?" + q.Encode()
}

func parsePeer(s string) (peer, error) {
	bad := func(why string) (peer, error) {
		return peer{}, fmt.Errorf("shm: data-plane address %q: %s", s, why)
	}
	rest, ok := strings.CutPrefix(s, scheme)
	if !ok {
		return bad("does not start with " + scheme)
	}
	path, query, _ := strings.Cut(rest, "?")
	path, err := url.PathUnescape(path)
	if err != nil || !strings.HasPrefix(path, "/") {
		return bad("no absolute file path")
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return bad(err.Error())
	}
	p := peer{Path: path, Host: q.Get("host"), Epoch: q.Get("epoch")}
	if p.Base, err = strconv.ParseUint(q.Get("base"), 10, 64); err != nil || p.Base == 0 {
		return bad("base is not a non-zero address")
	}
	if p.Len, err = strconv.ParseUint(q.Get("len"), 10, 64); err != nil || p.Len == 0 || p.Base+p.Len < p.Base || p.Len > maxLen {
		return bad("len is not a positive size that fits after base")
	}
	if p.Ino, err = strconv.ParseUint(q.Get("ino"), 10, 64); err != nil {
		return bad("ino is not an inode number")
	}
	if p.Host == "" || p.Epoch == "" {
		return bad("host and epoch are required")
	}
	return p, nil
}

// maxLen keeps a mapping's length an int on every platform Go runs on.
const maxLen = 1 << 50
