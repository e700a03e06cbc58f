package cudaipc

import (
	"context"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

// TestAnnouncingToAShardThatStopsReadingEnds: a shard that stops reading
// its connection (stuck, or gone without closing it) must not hold the
// producer's writes to it forever. Announcing fails by the write's
// deadline once the socket is full, the connection ends (a write cut
// mid-message leaves nothing the shard could still parse), and the
// items fail instead of hanging.
func TestAnnouncingToAShardThatStopsReadingEnds(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	require.NoError(t, err)
	peer := os.NewFile(uintptr(fds[1]), "shard end, never read")
	defer peer.Close()
	require.NoError(t, syscall.SetsockoptInt(fds[0], syscall.SOL_SOCKET, syscall.SO_SNDBUF, 4096))
	f := os.NewFile(uintptr(fds[0]), "producer end")
	c, err := net.FileConn(f)
	require.NoError(t, err)
	f.Close()
	conn := c.(*net.UnixConn)
	defer conn.Close()
	fd, ws, err := newWordsRegion()
	require.NoError(t, err)
	syscall.Close(fd)
	defer ws.unmap()

	a := &attachment{hello: hello{Generation: 7}, conn: conn, words: ws}
	w := &writer{cfg: Config{DialTimeout: time.Second}, log: transporttest.Quiet()}
	items := make([]transport.WriteItem, 64)
	idx := make([]int, len(items))
	for i := range items {
		items[i] = transport.WriteItem{Res: ids.ResID(i + 1), Token: ids.Token{byte(i + 1)}, Complete: true}
		idx[i] = i
	}
	var failed error
	for round := 0; failed == nil && round < wordSlots/len(items); round++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		w.announce(ctx, a, items, idx, w.cfg.DialTimeout, func(_ int, err error) { failed = err })
		cancel()
		a.pending = [wordSlots]bool{} // as if every write settled
	}
	require.ErrorIs(t, failed, transport.ErrConnLost, "the socket filled and the announcement failed by its deadline")
	_, err = conn.Read(make([]byte, 1))
	require.Error(t, err, "the connection ended with the failed announcement")
}
