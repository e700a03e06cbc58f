// Package peercred reads the uid of the process at the other end of a
// Unix socket, as the kernel recorded it when the connection was made
// (SO_PEERCRED): the one source of that fact for every Unix listener and
// dialer of the library (the control plane's, and the shm and cuda_ipc
// data planes'), each of which applies its own rule to it.
package peercred
