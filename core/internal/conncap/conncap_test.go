package conncap

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// clock is a fake time that moves a millisecond per tick.
type clock struct{ now time.Time }

func (c *clock) tick() time.Time { c.now = c.now.Add(time.Millisecond); return c.now }

func TestUnprovenMakeRoomOldestFirstAndProvenStay(t *testing.T) {
	var c clock
	tb := New[int](3, 3, 0)
	for _, k := range []int{1, 2, 3} {
		_, why := tb.Accepted(k, "a", c.tick())
		require.Empty(t, why)
	}
	tb.Prove(1)
	victim, why := tb.Accepted(4, "a", c.tick())
	require.Equal(t, Total, why)
	require.Equal(t, 2, victim, "the oldest unproven goes, not the proven one")

	tb.Busy(3, true, c.tick())
	victim, _ = tb.Accepted(5, "a", c.tick())
	require.Equal(t, 4, victim, "a connection in a request is never chosen")

	tb.Busy(3, false, c.tick())
	victim, _ = tb.Accepted(6, "a", c.tick())
	require.Equal(t, 5, victim, "a finished request starts its wait again: 5 waited longer than 3")

	tb.Prove(3)
	tb.Prove(6)
	victim, why = tb.Accepted(7, "a", c.tick())
	require.Equal(t, Total, why)
	require.Equal(t, 7, victim, "with every other one proven, the newcomer is refused")
	require.Equal(t, 3, tb.Len())

	tb.Gone(1)
	_, why = tb.Accepted(8, "a", c.tick())
	require.Empty(t, why, "a hang-up makes room")
}

func TestAFloodMakesRoomFromItsOwnAddress(t *testing.T) {
	var c clock
	tb := New[int](4, 4, 0)
	_, why := tb.Accepted(10, "engine", c.tick()) // unproven, oldest of all
	require.Empty(t, why)
	for k := 11; k <= 13; k++ {
		_, why := tb.Accepted(k, "flood", c.tick())
		require.Empty(t, why)
	}
	for k := 14; k <= 40; k++ {
		victim, why := tb.Accepted(k, "flood", c.tick())
		require.Equal(t, Total, why)
		require.Equal(t, k-3, victim, "the flood's own oldest goes, not the engine's older one")
	}
}

// A newcomer whose address holds other unproven connections makes room
// from them, even when another address holds more: a churning flood
// displaces itself, not an engine that shares its address with another
// flood.
func TestANewcomerMakesRoomFromItsOwnAddressFirst(t *testing.T) {
	var c clock
	tb := New[int](4, 4, 0)
	tb.Accepted(1, "crowded", c.tick())
	tb.Accepted(2, "crowded", c.tick())
	tb.Accepted(3, "churn", c.tick())
	tb.Accepted(4, "crowded", c.tick()) // the engine, newest of its address
	for k := 5; k < 50; k++ {
		victim, why := tb.Accepted(k, "churn", c.tick())
		require.Equal(t, Total, why)
		require.Equal(t, map[bool]int{true: 3, false: k - 1}[k == 5], victim, "the churning address's own oldest goes")
	}
	victim, _ := tb.Accepted(50, "elsewhere", c.tick())
	require.Equal(t, 1, victim, "a newcomer alone at its address takes from the most crowded, oldest first")
}

func TestOnTiedAddressesTheLongestWaitingGoes(t *testing.T) {
	var c clock
	tb := New[int](3, 3, 0)
	tb.Accepted(1, "x", c.tick())
	tb.Accepted(2, "y", c.tick())
	tb.Accepted(3, "z", c.tick())
	victim, why := tb.Accepted(4, "a", c.tick())
	require.Equal(t, Total, why)
	require.Equal(t, 1, victim, "one each: the connection that waited longest")
}

func TestAnAddressHoldsOnlyItsShare(t *testing.T) {
	var c clock
	tb := New[int](100, 2, 0)
	tb.Accepted(20, "flood", c.tick())
	tb.Accepted(21, "flood", c.tick())
	victim, why := tb.Accepted(22, "flood", c.tick())
	require.Equal(t, Peer, why, "over its share, with room in the cap")
	require.Equal(t, 20, victim)
	tb.Prove(21)
	tb.Prove(22)
	victim, why = tb.Accepted(23, "flood", c.tick())
	require.Equal(t, Peer, why)
	require.Equal(t, 23, victim, "with its share proven, the address's newcomer is refused")
	_, why = tb.Accepted(24, "engine", c.tick())
	require.Empty(t, why, "another address is not held to the first one's share")
}

func TestYoungConnectionsAreUnprovenUntilTheDeadline(t *testing.T) {
	var c clock
	tb := New[int](2, 2, time.Second)
	tb.Accepted(1, "a", c.tick())
	tb.Accepted(2, "a", c.tick())
	c.now = c.now.Add(time.Minute) // both lived past the deadline
	victim, why := tb.Accepted(3, "a", c.tick())
	require.Equal(t, Total, why)
	require.Equal(t, 3, victim)
}

func TestAReusedKeyIsCountedOnce(t *testing.T) {
	var c clock
	tb := New[int](2, 2, 0)
	tb.Accepted(1, "a", c.tick())
	_, why := tb.Accepted(1, "b", c.tick())
	require.Empty(t, why)
	require.Equal(t, 1, tb.Len())
	tb.Gone(1)
	tb.Gone(1)
	require.Equal(t, 0, tb.Len())
}
