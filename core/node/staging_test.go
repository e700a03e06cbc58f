package node

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/mooncaketest"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
)

// Device sources reach a transport that reads host memory only through
// the library's page-locked staging (no caller copies them first); a
// mooncake engine that registers GPU memory takes them itself.
func TestHostOnlyTransportsStageDeviceSources(t *testing.T) {
	cfg := config.DefaultProducer()
	stage, chunk := hostOnly(tcp.NewTCP(tcp.TCPConfig{}), cfg)
	require.True(t, stage)
	require.Equal(t, cfg.TCPChunkBytes, chunk)
	stage, _ = hostOnly(shm.New(shm.Config{Host: ids.HostIdentity("")}), cfg)
	require.True(t, stage, "shm")

	lib, err := mooncaketest.Build(t.TempDir(), "libtransfer_engine.so", false)
	require.NoError(t, err)
	for _, on := range []bool{false, true} {
		tr, err := mooncake.New(mooncake.Config{Library: lib, GPUMemory: &on})
		require.NoError(t, err)
		stage, chunk = hostOnly(tr, cfg)
		require.Equal(t, !on, stage, "GPU memory %v", on)
		require.Equal(t, int(mooncake.DefaultChunkBytes), chunk)
	}
	// Read from the build: the double links no CUDA runtime.
	tr, err := mooncake.New(mooncake.Config{Library: lib})
	require.NoError(t, err)
	stage, _ = hostOnly(tr, cfg)
	require.True(t, stage)
}
