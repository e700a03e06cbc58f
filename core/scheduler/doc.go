// Package scheduler is the consumer scheduler's runtime: what vLLM's engine
// core of a prefill/decode instance consults, through the connector's
// scheduler-side hooks, to learn whether an encoder output has arrived.
//
// The hooks run inside vLLM's scheduling loop and must never block, so no
// method of Scheduler does network I/O or waits (Wait excepted, which
// exists for tools and tests). They answer from the deterministic transfer
// table (package sched), which background goroutines keep current:
//   - one goroutine per consumer shard asks the shard for its event
//     endpoint (retrying until the shard is up), subscribes to it, and
//     afterwards periodically asks the shard for the status of items that
//     have waited a while, so an event lost while a socket reconnected
//     costs latency, never a request;
//   - one goroutine pumps readiness and gone events into the table;
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
