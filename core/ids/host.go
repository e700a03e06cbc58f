package ids

import "os"

// HostIdentity is what a consumer shard reports as its host, and what a
// producer compares with it to choose a same-host data plane: the
// configured name, else the host name. Both roles and the transport
// selection call it, so it lives here rather than under either role.
func HostIdentity(configured string) string {
	if configured != "" {
		return configured
	}
	if h, err := os.Hostname(); err == nil {
		return h
	}
	return "unknown"
}
