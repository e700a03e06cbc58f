package tcp

import (
	"bytes"
	"io"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// The receiver's reads allocate nothing: a read of a payload straight into
// the slab (with the next header behind it) once cost a closure and readv's
// iovecs, two allocations a frame on the data path.
func TestFrameReaderReadsWithoutAllocating(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer client.Close()
	server, err := ln.Accept()
	require.NoError(t, err)
	defer server.Close()

	fr := newFrameReader(&rconn{r: &tcpReceiver{}, c: server}, server)
	require.NotNil(t, fr.raw, "a TCP connection gives raw access")
	payload := bytes.Repeat([]byte{7, 1, 3}, 64<<10/3)
	dst := make([]byte, len(payload))
	read := func() {
		_, werr := client.Write(payload)
		_, rerr := io.ReadFull(fr, dst)
		if werr != nil || rerr != nil {
			t.Fatalf("write: %v; read: %v", werr, rerr)
		}
	}
	read()
	require.Equal(t, payload, dst)
	require.Zero(t, testing.AllocsPerRun(50, read), "allocations a 64 KiB read")
}
