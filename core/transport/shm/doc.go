// Package shm is the `shm` data plane: a producer and a consumer shard on
// one host move host-memory encoder outputs with one memcpy, through the
// consumer's slab in shared memory, instead of through TCP.
//
// # Consumer side
//
// The caller allocates the slab as a file under /dev/shm, mapped
// MAP_SHARED (Python: ecmooncake.native.shared_slab), and names it in the
// settings (slab_path). Listen checks that the file is what the slab is
// before it offers it: a regular file under /dev/shm, at least as large
// as the slab, fully allocated (a write into an unallocated tmpfs page of
// a full /dev/shm raises SIGBUS in the writing process), and mapped
// shared at the slab's address from file offset 0 (read from
// /proc/self/maps), so that bytes a producer writes into the file are the
// bytes the shard hands out. The shard publishes
//
//	shm://<path>?base=<slab address>&epoch=<hex>&host=<host identity>&ino=<inode>&len=<slab bytes>
//
// with the path escaped. The receiver is a transport.Direct: the shard
// puts RemoteAddr(region's slab offset) into each write grant and keeps the
// region's write open from grant to complete or abandon, so a write lands
// only inside a live reservation although it never asks the shard.
//
// # Producer side
//
// The writer maps each consumer's file once (read-write, MAP_SHARED) and
// copies each item into [grant address + Off, +len) after checking it
// against both the grant's size and the mapping. It refuses a consumer
// whose host identity is not its own (different hosts cannot share
// /dev/shm) and a file whose inode is not the advertised one (another
// file under the same name). A new epoch (the shard restarted) or inode
// makes it map the file afresh; Close unmaps everything, after the writes
// in progress have finished copying.
package shm
