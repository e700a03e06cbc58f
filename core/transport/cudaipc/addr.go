package cudaipc

import (
	"encoding/hex"
	"fmt"
	"net"
	"strings"
)

// nonceLen is the size of the nonce that names one incarnation of a
// shard's receiver.
const nonceLen = 16

// peerAddr is a shard's cuda_ipc address as it publishes it on the
// control plane: where its socket listens, and the nonce a producer must
// present there. The nonce is new for every Listen, so a shard that
// restarts at the same port has a new address, and a grant's address (a
// reserve reply names the data plane of the incarnation that granted)
// tells the writer which incarnation's slab the grant is in:
//
//	host:port?nonce=<32 hex digits>
type peerAddr struct {
	hostPort string
	nonce    [nonceLen]byte
}

func (p peerAddr) String() string {
	return p.hostPort + "?nonce=" + hex.EncodeToString(p.nonce[:])
}

func parseAddr(s string) (peerAddr, error) {
	bad := func(why string) (peerAddr, error) {
		return peerAddr{}, fmt.Errorf("cudaipc: data-plane address %q: %s", s, why)
	}
	hp, query, ok := strings.Cut(s, "?")
	if !ok {
		return bad("no nonce (a shard of another version?)")
	}
	if _, _, err := net.SplitHostPort(hp); err != nil {
		return bad(err.Error())
	}
	v, ok := strings.CutPrefix(query, "nonce=")
	if !ok || len(v) != 2*nonceLen {
		return bad(fmt.Sprintf("want nonce=<%d hex digits>", 2*nonceLen))
	}
	p := peerAddr{hostPort: hp}
	if _, err := hex.Decode(p.nonce[:], []byte(v)); err != nil {
		return bad("nonce: " + err.Error())
	}
	return p, nil
}
