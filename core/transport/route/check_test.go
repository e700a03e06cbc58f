package route

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// picky is a transport that refuses every address but ok.
type picky struct{ named }

func (p picky) CheckAddr(addr string) error {
	if addr != "ok" {
		return errors.New(string(p.named) + " refuses " + addr)
	}
	return nil
}

func TestCheckAddrAsksTheTransportTheDestinationNames(t *testing.T) {
	tr := New(Config{Network: picky{"mooncake"}, Local: named("cuda_ipc"), Host: "h"})
	for _, tc := range []struct {
		dest, err string
	}{
		{"mooncake://ok", ""},
		{"mooncake://bad", "mooncake refuses bad"},
		{"bad", "mooncake refuses bad"}, // no scheme: the network's
		{"cuda_ipc://anything", ""},     // a transport that cannot tell
		{"rdma://x", ""},                // unknown here: the write says so
	} {
		err := tr.CheckAddr(tc.dest)
		if tc.err == "" {
			require.NoError(t, err, tc.dest)
		} else {
			require.EqualError(t, err, tc.err, tc.dest)
		}
	}
}
