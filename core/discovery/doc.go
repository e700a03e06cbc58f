// Package discovery lets instances announce themselves to the EPD proxy
// instead of being listed on its command line.
//
// An instance (usually a prefill/decode consumer, but an encoder may do the
// same) sends a Registration to the proxy's POST /v1/ecm/register at start
// and again every Interval; the proxy keeps it for TTL after the last one
// and drops it after that. On Close the Registrar sends POST
// /v1/ecm/deregister so the proxy stops routing at once instead of waiting
// for the TTL. A proxy that restarts learns every instance again within one
// interval.
//
// The Registration names the instance's OpenAI-compatible base URL, its
// role, and for a consumer the control endpoint of its first shard
// (DP rank 0, TP rank 0) with its TP and DP sizes: the proxy derives the
// endpoint of DP rank r as ec_port + r*tp_size, the port convention the
// consumer shards listen on.
//
// Proxies accept registrations only from holders of their register token:
// RegistrarConfig.Token travels as "Authorization: Bearer <token>" with
// every call, and a proxy without a token has discovery off.
//
// The Registrar owns one goroutine; it recovers panics and every HTTP call
// has a deadline.
package discovery
