package gotests

import (
	"context"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// A whole request stream: two shards, several items per batch, duplicate
// images under different transfer ids, every byte checked on every shard.
func TestPushToShardedConsumer(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	items := makeItems(1, 12, 1, 3<<20, 4)
	out := c.deliver("req-1", items)
	require.Len(t, out.Done, len(items))
	for _, it := range items {
		require.True(t, c.sched.Has(it.hash), it.hash)
	}
	c.verify(items)

	// Every source is released once nothing reads it any more.
	require.Eventually(t, func() bool { return c.prod.Stats().Sources == 0 }, 30*time.Second, 10*time.Millisecond)
}

// A batch costs at most three control round trips per shard (peers once
// per consumer, one reserve_batch, one complete_batch), whatever its size.
func TestControlRoundTripsPerBatch(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	items := makeItems(2, 200, 64<<10, 64<<10, 0)
	out := c.pushAll("req-rt", items)
	require.Empty(t, out.Failed)
	require.LessOrEqual(t, c.prod.Stats().RoundTrips, uint64(3))
}

// A re-sent image is answered from the resident copy without a write.
func TestResidentCopyAnswersCached(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	first := makeItems(3, 1, 1<<20, 1<<20, 0)
	require.Empty(t, c.pushAll("req-a", first).Failed)
	c.verify(first) // acquire + release: now a resident copy on both shards

	again := []item{{tid: "tx-again", hash: first[0].hash, data: first[0].data}}
	before := c.shards[0].Stats().Data.Frames
	require.Empty(t, c.pushAll("req-b", again).Failed)
	w := c.wait([]string{"tx-again"}, 10*time.Second)
	require.Equal(t, []string{"tx-again"}, w.Available)
	require.Equal(t, before, c.shards[0].Stats().Data.Frames, "a cached item must not be written again")
	c.verify(again)
}

// Two requests naming one transfer_id with different images: only the
// second request is refused; the first completes.
func TestTransferIDCollisionFailsOnlyThatRequest(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	items := makeItems(4, 1, 4096, 4096, 0)
	require.Empty(t, c.pushAll("req-1", items).Failed)

	out := c.sched.Step(schedulerStepExpect("req-2", items[0].tid, "another-image"))
	require.Contains(t, out.ExpectErrors, "req-2")
	w := c.wait([]string{items[0].tid}, 30*time.Second)
	require.Equal(t, []string{items[0].tid}, w.Available)
}

// A write that names no live reservation is rejected and counted, and the
// data plane keeps serving.
func TestStaleAndForgedWritesRejected(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	w := tcp.NewTCP(tcp.TCPConfig{}).NewWriter()
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := w.Write(ctx, c.shards[0].Info().Data, []transport.WriteItem{{Res: 12345, Token: ids.Token{1}, Src: []byte("forged")}})
	require.Error(t, errs[0])
	st := c.shards[0].Stats()
	var rejected uint64
	for _, n := range st.Data.Rejected {
		rejected += n
	}
	require.Equal(t, uint64(1), rejected)
	require.Equal(t, uint64(0), st.InUse)

	// Still serving: a real push lands afterwards.
	items := makeItems(5, 2, 1024, 8192, 0)
	require.Empty(t, c.pushAll("req", items).Failed)
	c.verify(items)
}

// Garbage on the control socket gets an error reply; the server serves on.
func TestMalformedControlMessages(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	sock, err := zctx.NewSocket(zmq.DEALER)
	require.NoError(t, err)
	defer sock.Close()
	require.NoError(t, sock.SetLinger(0))
	require.NoError(t, sock.SetRcvtimeo(30*time.Second))
	require.NoError(t, sock.Connect(c.consumer))
	for _, msg := range []string{"not json", `{"v":1,"id":7,"op":"launch"}`, `{"v":99,"id":8,"op":"peers"}`, `{"v":1,"id":9,"op":"reserve_batch","body":{"items":[{"transfer_id":""}]}}`} {
		_, err := sock.SendMessage("", msg)
		require.NoError(t, err)
		frames, err := sock.RecvMessageBytes(0)
		require.NoError(t, err, "no reply to %q", msg)
		rep, err := wire.DecodeReply(frames[len(frames)-1])
		require.NoError(t, err)
		require.NotNil(t, rep.Err, "reply to %q must be an error", msg)
	}
	cl, err := control.Dial(zctx, c.consumer, quietLog())
	require.NoError(t, err)
	defer cl.Close()
	var peers wire.PeersReply
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, cl.Call(ctx, wire.OpPeers, struct{}{}, &peers))
	require.Equal(t, 1, peers.TPSize)
}

// Three requests carry one image under three transfer ids; one load serves
// all three. The two other pushes are cancelled on every shard at once,
// and once the requests finish only the loaded copy remains.
func TestOneLoadCancelsTheSiblings(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	data := makeItems(9, 1, 4096, 4096, 0)[0].data
	var items []item
	for _, id := range []string{"a", "b", "c"} {
		it := item{tid: "tx-sib-" + id, hash: "mm-sib", data: data}
		items = append(items, it)
		c.expect("req-sib-"+id, []item{it})
	}
	c.send(items)
	c.drain(len(items), 30*time.Second)
	w := c.wait(tids(items), 10*time.Second)
	require.ElementsMatch(t, tids(items), w.Available)

	served := make([]uint64, len(c.shards))
	for r, s := range c.shards {
		served[r] = s.Stats().Server.Served
	}
	load := c.sched.Step(scheduler.StepIn{Load: []string{"mm-sib"}}).Load
	require.Len(t, load, 1)
	require.Empty(t, load[0].Error)
	out := c.sched.Step(scheduler.StepIn{Loaded: []scheduler.LoadedIn{{TransferID: load[0].TransferID, OK: true}}})
	var siblings []string
	for _, id := range tids(items) {
		if id != load[0].TransferID {
			siblings = append(siblings, id)
		}
	}
	require.ElementsMatch(t, siblings, out.Cancelled, "the other pushes of the image are cancelled")
	for r, s := range c.shards {
		require.Eventually(t, func() bool { return s.Stats().Server.Served > served[r] }, hang, 10*time.Millisecond,
			"shard %d gets the cancel", r)
	}

	fin := c.sched.Step(scheduler.StepIn{Finished: []string{"req-sib-a", "req-sib-b", "req-sib-c"}})
	require.Empty(t, fin.Cancelled)
	st := c.sched.Stats().Table
	require.Equal(t, map[sched.State]int{sched.Ready: 1}, st.Records, "only the loaded copy outlives the requests")
	require.Zero(t, st.Requests)
}
