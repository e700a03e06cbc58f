// Package trace stamps the hops of an item's ready path, from the
// encoder's output to the PD's encoder cache, with CLOCK_MONOTONIC in the
// process where each hop happens, into one bounded ring per process.
//
// CLOCK_MONOTONIC is one clock for every process of a Linux host, so the
// stamps of a producer, a shard and a scheduler on one host compare: the
// benchmarks drain each process's ring (through the C ABI, ecm_trace) and
// Python's own (ecmooncake.trace) and print, per hop, the time since the
// hop before it. docs/design.md lists the hops.
//
// Off (the default) a stamp is one atomic load and a return: no clock
// read, no lock, no allocation. On, a stamp takes the ring's lock and
// overwrites the oldest entry once the ring is full (counted in Dropped),
// so a process left tracing holds a bounded amount of memory. Turn it on
// with the environment variable ECMOONCAKE_TRACE=N (N entries; 1 means
// DefaultCapacity) or with Enable.
package trace
