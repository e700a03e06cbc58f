// Command ecm-ceiling measures the ceiling of the TCP data plane: the data
// plane's own writer and receiver with no reservations around them (see
// tcp.CeilingSend). It is one end per process, so that each end has
// the GOMAXPROCS of the process it stands for:
//
//	ecm-ceiling recv [-listen 127.0.0.1:0] [-gomaxprocs N] [-chunk-bytes N] [-regions N] [-socket-buffer N]
//	ecm-ceiling send -to HOST:PORT[,HOST:PORT...] -schedule 1,2,4 -bytes N [-rounds N] [-gomaxprocs N] [-chunk-bytes N] [-socket-buffer N] [-timeout S]
//	ecm-ceiling copy -item-bytes N -count N [-rounds N] [-gomaxprocs N]
//
// recv prints {"addr": ...} once it listens, serves until its standard
// input closes, then prints {"frames": F, "bytes": B, ...}: what landed.
// send measures each entry of -schedule (connections to each address):
// -rounds rounds of -bytes over the same connections, and prints
// {"bytes_per_sec": [...], "rounds_bytes_per_sec": [[...], ...],
// "bytes_sent": N, ...}, bytes_per_sec holding each entry's fastest round. Each prints its parameters as it ran with them
// (GOMAXPROCS, chunk size, socket buffer) beside its figures. copy is the
// shm plane's copy alone (shm.CopyCeiling): it prints {"bytes_per_sec":
// fastest, "rounds_bytes_per_sec": [...], "params": ...}. Exit status
// 2 for bad arguments, 1 when the measurement failed.
//
// python/ecmooncake/ceiling.py starts these processes; build/build_lib.py
// builds this command beside libecmooncake.so.
package main
