package route

import (
	"strings"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

var _ transport.AddrChecker = (*Transport)(nil)

// CheckAddr asks the transport that dest names whether it can write there,
// so that a routed producer refuses a consumer at lookup (a mooncake
// engine of another protocol, an shm slab on another host) exactly as an
// unrouted one does, not at every write.
func (t *Transport) CheckAddr(dest string) error {
	name, addr, ok := strings.Cut(dest, "://")
	if !ok {
		name, addr = t.cfg.Network.Name(), dest
	}
	var tr transport.Transport
	switch {
	case name == t.cfg.Network.Name():
		tr = t.cfg.Network
	case t.cfg.Local != nil && name == t.cfg.Local.Name():
		tr = t.cfg.Local
	default:
		return nil // the write names the missing transport
	}
	if c, ok := tr.(transport.AddrChecker); ok {
		return c.CheckAddr(addr)
	}
	return nil
}
