package shm

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
)

// The producer wraps shm in package staged: a device source reaches the
// writer as page-locked host chunks, each keeping the grant, and lands
// where the item belongs, checked against the grant's size as a host item
// is.
func TestDeviceSourcesStageThroughTheLibrary(t *testing.T) {
	sh := listen(t, "h1")
	host := gpu.NewFakeHost(1)
	w := staged.New(staged.Config{Inner: New(Config{Host: "h1"}), Devices: host, ChunkBytes: 64 << 10, StagingBytes: 256 << 10}).NewWriter()
	defer w.Close()
	data := pattern(300<<10+3, 9)
	addr, window := host.Alloc(0, len(data))
	copy(window, data)
	n := uint64(len(data))
	items := []transport.WriteItem{
		{Res: 1, Off: 16, Addr: sh.recv.RemoteAddr(4096), Size: 16 + n, Dev: &transport.DeviceSrc{Addr: addr, Len: n}},
		{Res: 2, Off: 0, Addr: sh.recv.RemoteAddr(600 << 10), Size: n - 1, Dev: &transport.DeviceSrc{Addr: addr, Len: n}},
	}
	errs := w.Write(context.Background(), sh.addr, items)
	require.NoError(t, errs[0])
	require.Equal(t, data, sh.mem[4096+16:4096+16+len(data)])
	require.ErrorIs(t, errs[1], transport.ErrWriteBounds, "a chunk past the grant is refused as the whole item would be")
}
