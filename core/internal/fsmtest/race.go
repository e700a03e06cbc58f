//go:build race

package fsmtest

// Race reports whether the race detector is on; see SeedsUnderRace.
const Race = true
