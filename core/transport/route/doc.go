// Package route chooses the data plane per destination: CUDA IPC to a
// consumer shard on the same host, the configured network transport to
// any other, and whatever the configuration says for a named peer.
//
// A route.Transport is an ordinary transport.Transport built from two:
// Network (TCP, staged for GPU memory) and Local (cuda_ipc, absent when
// this process cannot use it).
//
//   - Consumer side, Listen listens on both and the receiver offers both
//     in the shard's peers reply (transport.MultiReceiver). A Local that
//     fails to listen (a slab that cannot be exported) is logged and left
//     out: the shard still serves over the network.
//   - Producer side, Pick is called once per shard with the shard's host
//     identity and offer, and returns a destination of the form
//     "name://address"; the writer sends each Write to the named
//     transport's writer. Each choice is logged once per shard, with why.
//     A Local that turns out unable to reach a shard (transport.
//     ErrUnsupported) is not chosen for that shard again.
package route
