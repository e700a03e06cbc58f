// Package producer runs the producer side of a push: the encoder
// instance's worker that owns encoder outputs and writes them into
// reservations on every shard of the consumer that needs them.
//
// A Producer drives the deterministic push manager (package push) from one
// goroutine, the driver. The driver ticks the manager, takes the effects it
// asks for (reserve, write, complete and cancel batches, one of each per
// destination shard at a time) and hands each to a goroutine that performs
// the I/O and reports the outcome back through the manager. So per batch the
// control plane costs two round trips (reserve_batch, complete_batch) plus
// one peers lookup per consumer for its lifetime, whatever the item count.
//
// Sources (encoder outputs) are memory the caller owns. The producer reads
// one only while a write from it is in flight and reports it released when
// no write and no pending push needs it any more; only then may the caller
// reuse or free it.
package producer
