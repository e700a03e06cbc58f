package peercred

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// Both ends of a connection within this process see this process's uid.
func TestUIDIsThePeersUID(t *testing.T) {
	client, server, err := pair(t)
	require.NoError(t, err)
	defer client.Close()
	defer server.Close()
	for _, c := range []*net.UnixConn{client, server} {
		uid, err := UID(c)
		require.NoError(t, err)
		require.Equal(t, uint32(os.Getuid()), uid)
	}
}

// A closed connection gives an error that names the option, not a uid.
func TestUIDOfAClosedConnectionFails(t *testing.T) {
	a, b, err := pair(t)
	require.NoError(t, err)
	require.NoError(t, a.Close())
	defer b.Close()
	_, err = UID(a)
	require.ErrorContains(t, err, "SO_PEERCRED")
}

func pair(t *testing.T) (*net.UnixConn, *net.UnixConn, error) {
	path := filepath.Join(t.TempDir(), "p")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, nil, err
	}
	defer ln.Close()
	a, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, nil, err
	}
	b, err := ln.AcceptUnix()
	return a, b, err
}
