// Package producer runs the producer side of a push: the encoder
// instance's worker that owns encoder outputs and writes them into
// reservations on every shard of the consumer that needs them.
//
// A Producer drives the deterministic push manager (package push) under its
// lock. A step takes the manager's Ready (one push.Effects, by the effect
// protocol of core/fsm) and hands each effect it holds (reserve, write,
// complete and cancel batches, one of each per destination shard at a
// time) to a goroutine that performs the I/O and reports the outcome back
// through the manager. Submit, Sources and each batch's goroutine as it
// ends take the step themselves, so the next batch starts without a
// hand-off (the goroutine launched for the batch is the one thread wake-up
// a call costs); one goroutine, the driver, takes it when a deadline falls
// due or when woken (by Cancel, or a step that failed). So per batch the
// control plane costs two round trips (reserve_batch, complete_batch) plus
// one peers lookup per consumer for its lifetime, whatever the item count.
// With the standing credit (credit_window_bytes, credit.go) a batch over
// a one-sided plane that fits the shard's window costs one: it takes its
// regions from the window, with no reserve_batch, and one claim_batch
// names them; a batch that does not fit reserves, counted.
//
// Shards restart. Every reserve reply names the incarnation that issued
// its grants (an epoch) and where that incarnation's data plane listens;
// each grant carries that address to its write, so bytes only ever go to
// the process that reserved room for them, and the batch after an idle
// restart goes through. A new epoch, or a control call that got no
// answer, drops the consumer's cached lookup. No I/O ever happens under
// the producer's lock (control clients are dialled outside it, and what is
// logged under it is queued for a goroutine that writes it), every
// goroutine recovers and reports a panic as the error of its work, and
// every channel a goroutine waits on closes on every path.
//
// With auth_secret set, every control client is a CURVE client with keys
// derived from it; without one, plain ZMTP. A shard that refuses the
// handshake fails the pushes to it at once with an error naming the
// setting to change, not at their deadlines.
//
// Sources (encoder outputs) are memory the caller owns. The producer reads
// one only while a write from it is in flight and reports it released when
// no write and no pending push needs it any more; only then may the caller
// reuse or free it.
package producer
