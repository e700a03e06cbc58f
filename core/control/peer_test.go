package control

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// peerRecorder answers status and records the Peer of each request.
type peerRecorder struct {
	mu    sync.Mutex
	peers []string
}

func (p *peerRecorder) Handle(req wire.Request) wire.Reply {
	p.mu.Lock()
	p.peers = append(p.peers, req.Peer)
	p.mu.Unlock()
	return wire.OKReply(req.ID, wire.StatusReply{})
}

func (p *peerRecorder) seen() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.peers...)
}

// The server names the connection each request came on: one name for
// every request of a connection, another for another connection, and
// never what the request itself says.
func TestTheServerNamesEachRequestsConnection(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, "peer-deployment-secret-0123456789", false)
	rec := &peerRecorder{}
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", rec, WithServerSecurity(sec))
	call := func(c *Client) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, c.Call(ctx, wire.OpStatus, wire.Status{}, nil))
	}
	var clients []*Client
	for range 2 {
		c, err := Dial(zctx, srv.Endpoint(), nil, WithClientSecurity(sec))
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		clients = append(clients, c)
	}
	call(clients[0])
	call(clients[0])
	call(clients[1])
	peers := rec.seen()
	require.Len(t, peers, 3)
	require.True(t, strings.HasPrefix(peers[0], "zmq:"), peers[0])
	require.Equal(t, peers[0], peers[1], "one connection, one name")
	require.NotEqual(t, peers[0], peers[2], "another connection, another name")

	// A frame that names a peer of its own is not believed.
	req, err := wire.DecodeRequest([]byte(`{"v":1,"id":7,"op":"status","peer":"zmq:victim","body":{}}`))
	if err == nil {
		require.Empty(t, req.Peer, "the field is never read off the wire")
	}
	b, err := json.Marshal(wire.Request{V: wire.Version, ID: 1, Op: wire.OpStatus, Peer: "zmq:victim"})
	require.NoError(t, err)
	require.NotContains(t, string(b), "victim", "nor written to it")
}
