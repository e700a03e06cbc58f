package mooncake

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// peer is what a consumer shard publishes as its mooncake data-plane
// address (in its peers reply), and all a producer needs besides the
// grants: which segment to open, which protocol it speaks, which memory
// it registered, and which incarnation of the shard this is.
//
// On the wire it is one string:
//
//	mooncake://<segment>?base=<addr>&epoch=<hex>&len=<bytes>&proto=<protocol>
//
// with the segment path-escaped. Epoch changes whenever the shard's engine
// is created anew (a restart, or a new shard on the same name), which is
// how a producer knows to drop its cached segment descriptor.
type peer struct {
	Segment string
	Proto   string
	Base    uint64 // address of the registered slab in the consumer
	Len     uint64
	Epoch   string
}

const scheme = "mooncake://"

func (p peer) String() string {
	q := url.Values{}
	q.Set("proto", p.Proto)
	q.Set("base", strconv.FormatUint(p.Base, 10))
	q.Set("len", strconv.FormatUint(p.Len, 10))
	q.Set("epoch", p.Epoch)
	return scheme + url.PathEscape(p.Segment) + "?" + q.Encode()
}

func parsePeer(s string) (peer, error) {
	bad := func(why string) (peer, error) {
		return peer{}, fmt.Errorf("mooncake: data-plane address %q: %s", s, why)
	}
	rest, ok := strings.CutPrefix(s, scheme)
	if !ok {
		return bad("does not start with " + scheme)
	}
	seg, query, _ := strings.Cut(rest, "?")
	seg, err := url.PathUnescape(seg)
	if err != nil || seg == "" {
		return bad("no segment name")
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return bad(err.Error())
	}
	p := peer{Segment: seg, Proto: q.Get("proto"), Epoch: q.Get("epoch")}
	if p.Base, err = strconv.ParseUint(q.Get("base"), 10, 64); err != nil || p.Base == 0 {
		return bad("base is not a non-zero address")
	}
	if p.Len, err = strconv.ParseUint(q.Get("len"), 10, 64); err != nil || p.Len == 0 || p.Base+p.Len < p.Base {
		return bad("len is not a positive size that fits after base")
	}
	if p.Proto == "" || p.Epoch == "" {
		return bad("proto and epoch are required")
	}
	return p, nil
}

// contains reports whether [addr, addr+n) lies inside the peer's slab.
func (p peer) contains(addr, n uint64) bool {
	return addr >= p.Base && n <= p.Len && addr-p.Base <= p.Len-n
}
