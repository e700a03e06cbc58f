// Command export is the C ABI of libecmooncake.so, in two halves:
//
//   - gate.c defines every function of include/ecmooncake.h. Each refuses
//     a child forked after the library was loaded, before any Go code
//     runs (entering the runtime there can wait forever on what a parent's
//     thread held at the fork), and otherwise calls its Go half. It
//     includes the header, so the compiler checks each definition against
//     the contract.
//   - main.go's //export functions, ecmgo_*, are the Go halves: each a thin
//     conversion of C types into a call of package capi. cgo writes their
//     prototypes without const, so they take char * where the header
//     promises const char *; gate.c casts.
//
// build/build_lib.py links with ecmooncake.map, which keeps every symbol
// but the header's local: tests/python/test_abi.py fails when the library
// defines any other dynamic symbol or the header and library drift apart.
package main
