// Package unixfd is what the same-host planes (shm, cudaipc) share on
// their abstract Unix sockets: admitting a peer by the uid the kernel
// recorded for it (SO_PEERCRED, read by core/internal/peercred, as the
// control plane reads it), and taking exactly one descriptor out of a
// message's SCM_RIGHTS.
//
// # Invariants
//
//   - It imports nothing under core/transport (only core/internal), so
//     any plane can use it without reaching back up the tree.
//   - TakeRights returns one descriptor or none: every descriptor a
//     message carried is either returned or closed, also on error, so a
//     peer cannot make this process leak descriptors.
package unixfd
