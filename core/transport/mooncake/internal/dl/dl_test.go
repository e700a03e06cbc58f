package dl

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestOpenAndSymSayWhyTheyFail(t *testing.T) {
	_, err := Open("/nonexistent/libnothing.so")
	require.ErrorContains(t, err, "/nonexistent/libnothing.so", "dlerror names the path")

	libc, err := Open("libc.so.6")
	require.NoError(t, err)
	f, err := libc.Sym("getpid")
	require.NoError(t, err)
	require.NotNil(t, f)
	_, err = libc.Sym("ecm_no_such_function")
	require.ErrorContains(t, err, "ecm_no_such_function")
}
