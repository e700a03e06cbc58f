package mooncake

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// An encoder's engine advertises the address its route to the consumer
// leaves from. The two-host end-to-end test failed before: in a namespace
// with no default route, the encoder advertised 127.0.0.1 to a PD on
// another address.
func TestOutboundHostTowards(t *testing.T) {
	for name, tc := range map[string]struct{ segment, want string }{
		"a loopback peer":     {"127.0.0.1:15442", "127.0.0.1"},
		"another loopback IP": {"127.0.0.2:1", "127.0.0.1"},
		"an IPv6 loopback":    {"[::1]:15442", "::1"},
		"a name, not an IP":   {"mooncake-segment-7", outboundHost()},
		"no port":             {"127.0.0.1", outboundHost()},
	} {
		t.Run(name, func(t *testing.T) {
			got := outboundHostTowards(tc.segment)
			if tc.segment == "[::1]:15442" && got != "::1" {
				t.Skipf("no IPv6 loopback here (got %s)", got)
			}
			require.Equal(t, tc.want, got)
		})
	}
}
