// Package fsmtest holds what the tests of the core's state machines share,
// and is imported by tests only:
//
//   - CheckAll checks a state enum the same way everywhere: every pair of
//     states against an independently written list of legal edges,
//     terminal states without exits, and distinct names;
//   - Corruptions checks that CheckInvariants sees each of a table of
//     corruptions of a known-good machine;
//   - Script runs a scripted, data-driven test: the clock, the parsing of
//     lines and expectations, and the commands every machine shares;
//   - ByteSource lets a fuzzer's input drive a random model.
package fsmtest
