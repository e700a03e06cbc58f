// Package consumer runs one consumer shard: the process object behind one
// TP rank of a prefill/decode instance that receives encoder outputs.
//
// A Shard wires the deterministic reservation table (package reserve) to
// the outside world through control.Links (ZeroMQ unless Options.Links
// says otherwise): a ROUTER control server at
// ec_port + dp_rank*tp_size + tp_rank, a data-plane listener of the chosen
// transport, and a PUSH socket that carries readiness and abandon events,
// and the end of every copy it had announced ready (gone events), to the
// consumer scheduler. The table is the only state; one mutex guards it
// and is held only for table calls, never across I/O, so a slow peer can
// never stall the control server or another writer.
//
// With auth_secret set, both of the shard's control sockets (the ROUTER
// and the event PUSH) use CURVE with keys derived from it, so only holders
// of the secret can reserve, complete, cancel or read events, and the
// data-plane tokens in reserve replies never cross the network in the
// clear. Without one, a shard bound beyond loopback serves loopback peers
// only unless allow_unauthenticated (package control, "Security"). Open
// logs once which of these applies.
//
// Invariants:
//   - every byte the data plane writes lands inside a live reservation,
//     because the transport asks the table (BeginWrite) for the destination
//     of every frame; a one-sided data plane (transport.Direct: RDMA writes
//     or copies straight into the slab) cannot ask, so the shard admits its writer
//     for the whole region at the grant, hands it the region's address
//     and nothing else, and ends the write at the writer's complete or
//     abandon, or after two leases if the writer vanished (direct.go);
//   - every event the table produces is sent exactly once, in order, right
//     after the call that produced it: the shard takes the table's Ready
//     after each call and each tick (the effect protocol of core/fsm);
//   - after Close returns, no goroutine of the shard touches the slab, so
//     the caller may free it.
//
// A slab in GPU memory has no host view; its data planes reach it through
// the sink's BeginRegion, which admits a frame exactly as BeginWrite does
// and answers with the frame's offset in the slab. The shard then offers
// every plane its receiver listens on (transport.Offer): TCP staged
// through page-locked memory and cuda_ipc for producers on the same host.
// cuda_ipc is one-sided (transport.DirectOf finds it next to TCP), so
// every write grant admits its region for a one-sided writer and carries
// its address; a producer over TCP ignores the address and its frames are
// admitted alongside, as before. cuda_ipc completes such a write in-band:
// its receiver watches the ready word the producer's GPU stores after the
// copies and calls the sink's CompleteRemote (direct.go), which ends the
// write landed and completes the item once, as a complete message would.
package consumer
