// Package shm is the `shm` data plane: a producer and a consumer shard on
// one host move host-memory encoder outputs with one memcpy, through the
// consumer's slab in shared memory, instead of through TCP.
//
// # Trust
//
// A producer never opens a path that a peer names. The consumer's slab is
// a memfd (no file in /dev/shm, so nothing is left behind when the
// consumer is killed), and the shard hands its descriptor over a Unix
// socket in the abstract namespace (SCM_RIGHTS), only to a peer of its own
// uid (SO_PEERCRED) that presents the nonce published on the
// authenticated control plane. The producer checks the socket's peer too
// (same uid), and the descriptor before it maps it: a regular memfd,
// sealed against shrinking (so that a consumer cannot truncate the slab
// under a copy and kill the producer with SIGBUS), opened read-write,
// owned by its uid, at least the announced size. Any other descriptor is
// refused with ErrRefusedPeer and left untouched.
//
// # Consumer side
//
// The caller allocates the slab as a sealed memfd, mapped MAP_SHARED
// (Python: ecmooncake.native.shared_slab), and passes its descriptor in
// the settings (slab_fd). Listen duplicates it and checks that it is what
// the slab is before it offers it: a sealed memfd at least as large as the
// slab, fully allocated, and mapped shared at the slab's address from
// file offset 0 (read from /proc/self/maps), so that bytes a producer
// writes into the memfd are the bytes the shard hands out. The shard
// publishes
//
//	shm://@ecmooncake-shm-<pid>-<hex>?base=<slab address>&host=<host identity>&len=<slab bytes>&nonce=<hex>
//
// and serves at most Config.MaxConns producer connections at once;
// refusals are counted in RecvStats.Closed by reason. The receiver is a
// transport.Direct: the shard puts RemoteAddr(region's slab offset) into
// each write grant and keeps the region's write open from grant to
// complete or abandon, so a write lands only inside a live reservation
// although it never asks the shard.
//
// # Producer side
//
// The writer fetches and maps each shard's slab once (read-write,
// MAP_SHARED) and copies each item into [grant address + Off, +len) after
// checking it against both the grant's size and the mapping. It refuses a
// consumer whose host identity is not its own (different hosts cannot
// share memory) before it connects anywhere. The shard keeps the
// handshake's connection open; when it ends (the shard closed or died) the
// writer unmaps the slab, so that a dead consumer's memory is freed. A new
// address (the shard restarted) makes it map afresh; Close unmaps
// everything, after the writes in progress have finished copying.
//
// # Handshake
//
// See handshake.go for the two fixed-size messages (hello, grant); every
// decoder of peer bytes has a fuzz target.
package shm
