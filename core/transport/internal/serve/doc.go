// Package serve is what every receiver that accepts connections shares:
// the accept loop (Acceptor), the set of served connections capped at a
// maximum (Conns), panic logging for a plane's goroutines (LogPanic),
// counters by reason (Counts) and the clipping of an error's text to a
// wire message's room (ClipMsg). tcp, shm and cudaipc use it, and the
// root package's RecvCounters build on Counts.
//
// # Invariants
//
//   - It imports nothing under core/transport, so any plane and the root
//     can share it without a plane reaching back up the tree.
//   - A failing Accept (out of descriptors) is retried after a wait that
//     doubles from 5ms to 1s; it never ends the listener.
//   - A panic in Accept costs that connection, not the loop; Conns closes
//     a connection past its maximum at once, and Close cuts every one.
package serve
