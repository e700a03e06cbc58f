package cudaipc

import (
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
)

// nonceLen is the size of the nonce that names one incarnation of a
// shard's receiver.
const nonceLen = 16

const (
	// socketPrefix starts every socket name a producer connects to, so
	// that a peers reply cannot point it at another program's abstract
	// socket.
	socketPrefix = "ecmooncake-cudaipc-"
	// maxSocket keeps the name, with its leading NUL, inside sun_path.
	maxSocket = 100
)

// peerAddr is a shard's cuda_ipc address as it publishes it on the
// control plane: the abstract Unix socket that greets producers, and the
// nonce a producer must present there. The nonce is new for every Listen,
// so a shard that restarts has a new address, and a grant's address (a
// reserve reply names the data plane of the incarnation that granted)
// tells the writer which incarnation's slab the grant is in:
//
//	@ecmooncake-cudaipc-<pid>-<16 hex digits>?nonce=<32 hex digits>
type peerAddr struct {
	socket string // abstract name, without the '@'
	nonce  [nonceLen]byte
}

func (p peerAddr) String() string {
	return "@" + p.socket + "?nonce=" + hex.EncodeToString(p.nonce[:])
}

func parseAddr(s string) (peerAddr, error) {
	bad := func(why string) (peerAddr, error) {
		return peerAddr{}, fmt.Errorf("cudaipc: data-plane address %q: %s", s, why)
	}
	name, query, ok := strings.Cut(s, "?")
	if !ok {
		return bad("no nonce (a shard of another version?)")
	}
	name, ok = strings.CutPrefix(name, "@")
	if !ok {
		return bad("not an abstract socket (@name): a shard of another version?")
	}
	if err := checkSocketName(name); err != nil {
		return bad(err.Error())
	}
	v, ok := strings.CutPrefix(query, "nonce=")
	if !ok || len(v) != 2*nonceLen {
		return bad(fmt.Sprintf("want nonce=<%d hex digits>", 2*nonceLen))
	}
	p := peerAddr{socket: name}
	if _, err := hex.Decode(p.nonce[:], []byte(v)); err != nil {
		return bad("nonce: " + err.Error())
	}
	return p, nil
}

// checkSocketName accepts only the names Listen makes: the project's
// prefix, then lower-case letters, digits and dashes.
func checkSocketName(name string) error {
	return unixfd.CheckSocketName(name, socketPrefix, maxSocket)
}
