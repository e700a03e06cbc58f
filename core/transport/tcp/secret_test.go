package tcp

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// The data plane's secret is the settings' type: a config that holds it
// prints a placeholder under every verb a log line might use.
func TestASecretInAConfigNeverPrints(t *testing.T) {
	held := struct{ Secret Secret }{Secret: testSecret}
	for _, verb := range []string{"%v", "%+v", "%#v", "%s"} {
		out := fmt.Sprintf(verb, held)
		require.NotContains(t, out, string(testSecret), verb)
		require.Contains(t, out, "[redacted]", verb)
	}
	require.Empty(t, Secret("").String(), "no secret prints as nothing")
}
