// Package mooncaketest builds and drives the test double of Mooncake
// TransferEngine's C API (../testdata/transfer_engine_double.c): a small C
// library that keeps the API's contract and moves real bytes between
// engines over TCP, with functions to inject faults and read counters.
//
// Tests build it with the system C compiler (Build), point the mooncake
// transport's Config.Library at the result, and load it here too (Open)
// to reach the double's own functions. Both dlopen the same file, so they
// share one copy of the library and its state.
package mooncaketest
