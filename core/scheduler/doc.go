// Package scheduler is the consumer scheduler's runtime: what vLLM's engine
// core of a prefill/decode instance consults, through the connector's
// scheduler-side hooks, to learn whether an encoder output has arrived.
//
// The hooks run inside vLLM's scheduling loop and must never block, so no
// method of Scheduler waits or does network I/O beyond reading, without
// waiting, what has arrived in its event sockets (Poll; Wait excepted,
// which exists for tools and tests). They answer from the deterministic transfer
// table (package sched), which background goroutines keep current:
//   - one goroutine per consumer shard asks the shard for its event
//     endpoint (retrying until the shard is up), subscribes to it, and
//     afterwards periodically asks the shard for the status of items that
//     have waited a while, so an event lost while a socket reconnected
//     costs latency, never a request;
//   - the events of shards on this host are applied by the reader of
//     their Unix socket, or, sooner, by Poll on the caller's thread: the
//     engine's loop steps without pause while a request waits, and each
//     Step and each pass of the connector's hooks first applies what has
//     arrived, so an item is seen without the wake of a thread that slept;
//   - one goroutine pumps the other shards' events (over ZeroMQ) into the
//     table;
//   - one goroutine applies deadlines when they fall due.
//
// With auth_secret set, the scheduler's control clients and its event
// subscriber are CURVE clients with keys derived from it: the shards serve
// and publish only to holders of the secret.
//
// Every Step, and the goroutine that applies deadlines, takes the table's
// Ready (one sched.Effects, by the effect protocol of core/fsm): its
// cancels go to the shards, its failures to the next Step's answer.
//
// An item is available only when every TP shard holds it: the table
// counts readiness per shard.
package scheduler
