package sched

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

func TestScenarios(t *testing.T) {
	two := Config{Shards: 2}
	cases := []struct {
		name   string
		cfg    Config
		script string
	}{
		{"both shards in order", two, `
			expect r1 t1=h1
			state t1 -> WaitingEvent
			has h1 -> no
			ensure r1 -> wait
			ready 0 t1 h1 100
			state t1 -> WaitingEvent
			has h1 -> no
			ensure r1 -> wait
			ready 1 t1 h1 100
			state t1 -> Available
			has h1 -> yes
			ensure r1 -> ready
			stats -> live=Available:1 ignored=0 requests=1
		`},
		{"shards reversed and duplicated", two, `
			expect r1 t1=h1
			ready 1 t1 h1
			ready 1 t1 h1
			ready 1 t1 h1
			state t1 -> WaitingEvent
			ready 0 t1 h1
			state t1 -> Available
			ready 0 t1 h1
			ready 1 t1 h1
			state t1 -> Available
			stats -> ignored=0
		`},
		{"one shard only never makes it available", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 0 t1 h1
			at 59s
			state t1 -> WaitingEvent
			has h1 -> no
			ensure r1 -> wait
			tick -> -
			at 60s
			tick -> r1/t1
			state t1 -> Unavailable
			reason r1 t1 -> push did not arrive within 60s (1 of 2 shards ready)
			ensure r1 -> failed t1
		`},
		{"push that never comes fails exactly at the deadline", two, `
			at 10s
			expect r1 t1=h1
			next -> 1m10s
			at 1m9.999999999s
			tick -> -
			state t1 -> WaitingEvent
			at 1m10s
			tick -> r1/t1
			tick -> -
			state t1 -> Unavailable
			next -> none
			reason r1 t1 -> push did not arrive within 60s (0 of 2 shards ready)
		`},
		{"events before expect are applied at expect", two, `
			ready 1 t1 h1
			ready 0 t1 h1
			stats -> early=1 live=-
			state t1 -> none
			has h1 -> no
			at 5s
			expect r1 t1=h1
			state t1 -> Available
			stats -> early=0 live=Available:1 ignored=0
			ensure r1 -> ready
		`},
		{"early event for one shard, the other after expect", two, `
			ready 0 t1 h1
			expect r1 t1=h1
			state t1 -> WaitingEvent
			ready 1 t1 h1
			state t1 -> Available
		`},
		{"early failure is applied at expect", two, `
			ready 0 t1 h1
			fail 1 t1 h1 pool full
			expect r1 t1=h1
			state t1 -> Unavailable
			reason r1 t1 -> shard 1: pool full
			tick -> r1/t1
		`},
		{"early events for other content are ignored at expect", two, `
			ready 0 t1 hX
			ready 1 t1 hX
			expect r1 t1=h1
			state t1 -> WaitingEvent
			stats -> ignored=2 early=0
		`},
		{"early events expire after the event wait", two, `
			ready 0 t1 h1
			next -> 1m0s
			at 59s
			stats -> early=1
			at 60s
			tick -> -
			stats -> early=0 dropped=1
			expect r1 t1=h1
			ready 1 t1 h1
			state t1 -> WaitingEvent
		`},
		{"early events are bounded, oldest dropped first", Config{Shards: 2, MaxEarlyEvents: 2}, `
			ready 0 t1 h1
			ready 0 t2 h2
			ready 0 t3 h3
			stats -> early=2 dropped=1
			expect r1 t1=h1 t3=h3
			ready 1 t1 h1
			ready 1 t3 h3
			state t1 -> WaitingEvent
			state t3 -> Available
			stats -> early=1
		`},
		{"events that do not fit are ignored", two, `
			expect r1 t1=h1
			ready 2 t1 h1
			ready -1 t1 h1
			ready 0 t1 hX
			fail 1 t1 hX bogus
			ready 0 t1 h1 100
			ready 1 t1 h1 200
			state t1 -> WaitingEvent
			stats -> ignored=5
			ready 1 t1 h1 100
			state t1 -> Available
		`},
		{"a failure from any shard makes it unavailable", two, `
			expect r1 t1=h1 t2=h2
			ready 0 t1 h1
			fail 1 t1 h1 reservation refused: too large
			state t1 -> Unavailable
			ensure r1 -> failed t1
			failures r1 -> t1:shard 1: reservation refused: too large
			ready 0 t1 h1
			stats -> ignored=1
			tick -> r1/t1
			tick -> -
		`},
		{"collision refuses the second request only", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			expect r2 t1=h2 -> collision
			expect r3 t9=h9 t1=h2 -> collision
			expect r4 t5=h5 t5=h6 -> collision
			state t9 -> none
			state t5 -> none
			stats -> requests=1 collisions=3
			ready 1 t1 h1
			state t1 -> Available
			ensure r1 -> ready
		`},
		{"collision with an ended transfer", two, `
			expect r1 t1=h1
			at 60s
			tick -> r1/t1
			expect r2 t1=h2 -> collision
			expect r3 t1=h1
			failures r3 -> t1:transfer t1 already ended (Unavailable: push did not arrive within 60s (0 of 2 shards ready)) final
			tick -> r3/t1
		`},
		{"invalid items are refused", two, `
			expect r1 t1= -> invalid
			expect r1 =h1 -> invalid
			stats -> requests=0
		`},
		{"same image in two requests shares one record", two, `
			expect r1 t1=h1
			expect r2 t1=h1
			expect r1 t1=h1
			stats -> requests=2 live=WaitingEvent:1
			ready 0 t1 h1
			ready 1 t1 h1
			finish r1 -> -
			state t1 -> Available
			ensure r2 -> ready
			finish r2 -> t1
			state t1 -> Cancelled
		`},
		{"finishing one of two waiting requests leaves the other waiting", two, `
			expect r1 t1=h1
			expect r2 t1=h1
			finish r1 -> -
			state t1 -> WaitingEvent
			at 60s
			tick -> r2/t1
		`},
		{"same content through two transfers: one load serves both", two, `
			expect r1 t1=h1
			expect r2 t2=h1
			ready 0 t1 h1
			ready 1 t1 h1
			has h1 -> yes
			ensure r2 -> ready
			load h1 -> t1
			loaded t1 ok
			state t1 -> Ready
			state t2 -> Cancelled
			cancels -> t2
			at 60s
			tick -> -
			ensure r2 -> ready
		`},
		{"an aborted request leaves the transfer another request was told is there", two, `
			# the soak's "load cannot start": rB is answered ready through
			# rA's transfer of the same image while its own push still waits
			expect rA tA=h1
			expect rB tB=h1
			ready 0 tA h1
			ready 1 tA h1
			ensure rB -> ready
			# rA aborts before its load; the next step schedules rB
			finish rA -> -
			state tA -> Available
			has h1 -> yes
			ensure rB -> ready
			load h1 -> tA
			loaded tA ok
			cancels -> tB
			ensure rB -> ready
			finish rB -> -
			stats -> live=Ready:1 requests=0 ended=Cancelled:1
		`},
		{"a transfer kept for another request ends with the last request for its image", two, `
			expect rA tA=h1
			expect rB tB=h1
			expect rC tC=h2
			ready 0 tA h1
			ready 1 tA h1
			finish rA -> -
			finish rC -> tC
			state tA -> Available
			state tB -> WaitingEvent
			finish rB -> tA,tB
			state tA -> Cancelled
			state tB -> Cancelled
			stats -> live=- requests=0 ended=Cancelled:3
		`},
		{"a kept transfer still serves a request whose own push failed", two, `
			expect rA tA=h1
			expect rB tB=h1
			ready 0 tA h1
			ready 1 tA h1
			finish rA -> -
			fail 0 tB h1 no room
			tick -> -
			ensure rB -> ready
			load h1 -> tA
			loaded tA ok
			ensure rB -> ready
			finish rB -> -
		`},
		{"a kept transfer that expires fails nobody it was kept for", Config{Shards: 2, AvailableTTL: 30 * time.Second}, `
			expect rA tA=h1
			expect rB tB=h1
			ready 0 tA h1
			ready 1 tA h1
			finish rA -> -
			ensure rB -> ready
			at 30s
			tick -> -
			state tA -> Expired
			ensure rB -> wait
			ready 0 tB h1
			ready 1 tB h1
			ensure rB -> ready
			load h1 -> tB
		`},
		{"a transfer stays for a live request whose earlier copy is gone", Config{Shards: 2, ResidentTTL: 30 * time.Second}, `
			# the fuzzer's "took h1 from a request still waiting for it":
			# rB was served once, its copy expired, and rA's transfer of the
			# same image is what Ensure now answers rB ready from
			expect rB tB=h1
			ready 0 tB h1
			ready 1 tB h1
			load h1 -> tB
			loaded tB ok
			freed h1
			at 30s
			tick -> -
			state tB -> Expired
			expect rA tA=h1
			ready 0 tA h1
			ready 1 tA h1
			ensure rB -> ready
			finish rA -> -
			state tA -> Available
			has h1 -> yes
			ensure rB -> ready
			load h1 -> tA
			loaded tA ok
			finish rB -> -
		`},
		{"request aborted mid-transfer", two, `
			expect r1 t1=h1 t2=h2 t3=h3
			ready 0 t1 h1
			ready 1 t1 h1
			ready 0 t2 h2
			ready 0 t3 h3
			ready 1 t3 h3
			load h1 -> t1
			finish r1 -> t2,t3
			state t1 -> Loading
			state t2 -> Cancelled
			state t3 -> Cancelled
			ready 1 t2 h2
			stats -> ignored=1 requests=0
			loaded t1 ok
			state t1 -> Ready
			finish r1 -> -
			tick -> -
		`},
		{"a failure for a finished request is not reported", two, `
			expect r1 t1=h1
			fail 0 t1 h1 boom
			next -> 0s
			finish r1 -> -
			tick -> -
			next -> none
		`},
		{"loading deadline", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			at 1s
			load h1 -> t1
			load h1 -> t1
			next -> 31s
			at 30.999999999s
			tick -> -
			state t1 -> Loading
			at 31s
			tick -> r1/t1
			state t1 -> Unavailable
			reason r1 t1 -> load did not finish within 30s
			loaded t1 ok
			stats -> reports=1
		`},
		{"failed load", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h1 -> t1
			loaded t1 fail region gone
			state t1 -> Failed
			reason r1 t1 -> load failed: region gone
			tick -> r1/t1
			load h1 -> error
		`},
		{"available transfer expires when never loaded", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			at 299s
			tick -> -
			at 300s
			tick -> r1/t1
			state t1 -> Expired
			reason r1 t1 -> not loaded within 300s of arriving
		`},
		{"freed item is reloaded from resident", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h9 -> error
			load h1 -> t1
			loaded t1 ok
			load h1 -> t1
			freed h1
			state t1 -> Resident
			has h1 -> yes
			next -> none
			# r1 is preempted and asks again: the resident copy serves it
			ensure r1 -> ready
			load h1 -> t1
			state t1 -> Loading
			loaded t1 ok
			freed h1
			# a later request pushed with its own transfer prefers the fresh one
			expect r2 t2=h1
			ready 0 t2 h1
			ready 1 t2 h1
			load h1 -> t2
			state t1 -> Resident
			loaded t2 ok
			finish r1 -> -
			finish r2 -> -
			stats -> live=Ready:1,Resident:1
		`},
		{"siblings of a loaded transfer are cancelled", two, `
			expect r1 t1=h1
			expect r2 t2=h1
			expect r3 t3=h1
			ready 0 t1 h1
			ready 1 t1 h1
			ready 0 t2 h1
			ready 1 t2 h1
			ready 0 t3 h1
			cancels -> -
			load h1 -> t1
			loaded t1 ok
			# one load serves all three requests: the other pushes of the
			# image are cancelled on the shards now, not left to their TTLs
			cancels -> t2,t3
			cancels -> -
			state t2 -> Cancelled
			state t3 -> Cancelled
			ensure r2 -> ready
			ensure r3 -> ready
			ready 1 t3 h1
			stats -> ignored=1
			freed h1
			finish r1 -> -
			finish r2 -> -
			finish r3 -> -
			cancels -> -
			stats -> live=Resident:1 requests=0 ended=Cancelled:2
		`},
		{"a sibling that is loading or resident is left alone", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h1 -> t1
			loaded t1 ok
			freed h1
			expect r2 t2=h1
			ready 0 t2 h1
			ready 1 t2 h1
			load h1 -> t2
			loaded t2 ok
			cancels -> -
			state t1 -> Resident
			finish r2 -> -
			stats -> live=Ready:1,Resident:1 requests=1
		`},
		{"a lost shard takes every item with it", two, `
			expect r1 t1=h1 t2=h2 t3=h3 t4=h4
			ready 0 t1 h1
			ready 1 t1 h1
			ready 0 t2 h2
			ready 1 t2 h2
			ready 0 t3 h3
			ready 1 t3 h3
			ready 0 t4 h4
			load h2 -> t2
			load h3 -> t3
			loaded t3 ok
			ready 1 t9 h9
			has h1 -> yes
			lost 1
			has h1 -> no
			has h3 -> no
			state t1 -> Expired
			state t2 -> Unavailable
			state t3 -> Expired
			state t4 -> Unavailable
			tick -> r1/t1,r1/t2,r1/t4
			reason r1 t1 -> shard 1 lost
			load h1 -> error
			# an early event of the lost shard is forgotten with it
			expect r2 t9=h9
			ready 0 t9 h9
			state t9 -> WaitingEvent
		`},
		{"a restarted shard takes what it had, not what it waits for", two, `
			expect r1 t1=h1 t2=h2 t3=h3
			ready 0 t1 h1
			ready 1 t1 h1
			ready 1 t2 h2
			ready 0 t3 h3
			restarted 1
			state t1 -> Expired
			state t2 -> Unavailable
			state t3 -> WaitingEvent
			has h1 -> no
			tick -> r1/t1,r1/t2
			ready 1 t3 h3
			state t3 -> Available
		`},
		{"resident copy expires after its time to live", Config{Shards: 2, ResidentTTL: 100 * time.Second}, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h1 -> t1
			loaded t1 ok
			at 10s
			freed h1
			next -> 1m50s
			at 110s
			tick -> -
			state t1 -> Expired
			has h1 -> no
			ensure r1 -> failed t1
			reason r1 t1 -> loaded earlier, no longer on every shard (Expired: resident copy expired after 100s)
		`},
		{"evicted resident copy fails the request that waits for it", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h1 -> t1
			loaded t1 ok
			expect r2 t1=h1
			ensure r2 -> ready
			freed h1
			expect r3 t1=h1
			fail 1 t1 h1 evicted
			state t1 -> Expired
			tick -> r3/t1
			ensure r2 -> failed t1
			reason r3 t1 -> shard 1: evicted
		`},
		{"a gone copy ends every record the shard reported from it, cached answers included", two, `
			expect r1 t1=h1
			ready 0 t1 h1 100
			ready 1 t1 h1 100
			load h1 -> t1
			loaded t1 ok
			freed h1
			state t1 -> Resident
			# Another push of the content, answered cached by both shards,
			# and a third that only shard 1 has answered so far.
			expect r2 t2=h1
			ready 0 t2 h1 100
			ready 1 t2 h1 100
			state t2 -> Available
			expect r3 t3=h1
			ready 1 t3 h1 100
			gone 0 h1 evicted
			state t1 -> Expired
			state t2 -> Expired
			state t3 -> WaitingEvent
			has h1 -> no
			load h1 -> error
			tick -> r2/t2
			reason r2 t2 -> shard 0 no longer holds h1: evicted
			ensure r1 -> failed t1
			# Shard 0's word on t3 comes from a new copy, after the gone event.
			ready 0 t3 h1 100
			state t3 -> Available
			has h1 -> yes
			ensure r3 -> ready
			stats -> ignored=0
		`},
		{"a gone copy that another shard still holds is still not offered", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			gone 1 h1 lease expired
			state t1 -> Expired
			has h1 -> no
			tick -> r1/t1
			reason r1 t1 -> shard 1 no longer holds h1: lease expired
		`},
		{"a gone copy fails the load that was about to pin it", two, `
			expect r1 t1=h1
			ready 0 t1 h1
			ready 1 t1 h1
			load h1 -> t1
			gone 1 h1 lease expired
			state t1 -> Unavailable
			loaded t1 ok
			stats -> reports=1
			tick -> r1/t1
		`},
		{"a gone copy fails early events it had announced", two, `
			ready 0 t1 h1
			ready 1 t1 h1
			gone 1 h1
			stats -> early=1
			expect r1 t1=h1
			state t1 -> Unavailable
			tick -> r1/t1
			reason r1 t1 -> shard 1 no longer holds h1
		`},
		{"gone events out of range are ignored, of unknown content harmless", two, `
			gone 2 h1 evicted
			gone -1 h1 evicted
			stats -> ignored=2
			gone 0 hZ evicted
			stats -> ignored=2 early=0 live=-
			expect r1 t1=h1
			ready 0 t1 h1
			gone 1 h1 evicted
			state t1 -> WaitingEvent
		`},
		{"tombstones are bounded", Config{Shards: 2, MaxTombstones: 2}, `
			expect r1 t1=h1 t2=h2 t3=h3
			finish r1 -> t1,t2,t3
			stats -> tombs=2 ended=Cancelled:3 live=-
			state t1 -> none
			state t2 -> Cancelled
			state t3 -> Cancelled
		`},
		{"the generation moves with the answers only", two, `
			gen -> same
			has h1 -> no
			ensure r1 -> ready
			gen -> same
			expect r1 t1=h1
			gen -> changed
			expect r1 t1=h1
			gen -> same
			# half the shards: no answer changes
			ready 0 t1 h1
			has h1 -> no
			ensure r1 -> wait
			gen -> same
			# an event for a transfer nobody expects yet is kept aside
			ready 0 t9 h9
			gen -> same
			ready 1 t1 h1
			gen -> changed
			has h1 -> yes
			ensure r1 -> ready
			gen -> same
			load h1 -> t1
			gen -> changed
			loaded t1 ok
			gen -> changed
			freed h1
			gen -> changed
			finish r1 -> -
			gen -> changed
			finish r1 -> -
			gen -> same
			expect r2 t2=h2
			gen -> changed
			at 59s
			tick -> -
			gen -> same
			at 60s
			tick -> r2/t2
			gen -> changed
			lost 0
			gen -> changed
		`},
		{"defaults: one shard", Config{}, `
			expect r1 t1=h1
			ready 0 t1 h1
			state t1 -> Available
			ready 1 t1 h1
			stats -> ignored=1
		`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runScript(t, tc.cfg, tc.script) })
	}
}

func TestFailureCarriesIdentity(t *testing.T) {
	tb := New(Config{Shards: 1})
	require.NoError(t, tb.Expect("r1", []Expected{{"t1", "h1"}}, base))
	got := tb.Ready(base.Add(DefaultEventWait)).Failures
	require.Equal(t, []Failure{{
		RequestID: "r1", TransferID: "t1", MMHash: "h1",
		Reason:    "push did not arrive within 60s (0 of 1 shards ready)",
		Retryable: true,
	}}, got)
}

func TestCollisionErrorNamesBothHashes(t *testing.T) {
	tb := New(Config{})
	require.NoError(t, tb.Expect("r1", []Expected{{"t1", "h1"}}, base))
	err := tb.Expect("r2", []Expected{{"t1", "h2"}}, base)
	require.ErrorIs(t, err, ErrCollision)
	require.ErrorContains(t, err, "expect r2: transfer t1 names mm_hash h2, already known as h1")
}

func TestStartLoadErrorListsTransfers(t *testing.T) {
	tb := New(Config{Shards: 2})
	require.NoError(t, tb.Expect("r1", []Expected{{"t1", "h1"}}, base))
	_, err := tb.StartLoad("h1", base)
	require.ErrorIs(t, err, ErrNotAvailable)
	require.ErrorContains(t, err, "t1=WaitingEvent")
}

func TestDeadlineHeapStaysBounded(t *testing.T) {
	// Each load/free cycle leaves a stale deadline entry behind; the heap
	// must be rebuilt rather than grow with the number of cycles.
	tb := New(Config{Shards: 1, ResidentTTL: time.Hour})
	now := base
	require.NoError(t, tb.Expect("r1", []Expected{{"t1", "h1"}}, now))
	tb.OnEvent(Event{TransferID: "t1", MMHash: "h1", Ready: true}, now)
	for i := 0; i < 1000; i++ {
		now = now.Add(time.Millisecond)
		_, err := tb.StartLoad("h1", now)
		require.NoError(t, err)
		tb.Loaded("t1", true, "", now)
		tb.Freed("h1", now)
	}
	require.LessOrEqual(t, len(tb.deadlines), 2*len(tb.records)+64)
	require.NoError(t, tb.CheckInvariants())
}

func TestCheckInvariantsCatchesCorruption(t *testing.T) {
	build := func() *Table {
		tb := New(Config{Shards: 2, MaxTombstones: 4})
		require.NoError(t, tb.Expect("r1", []Expected{{"t1", "h1"}, {"t2", "h2"}}, base))
		require.NoError(t, tb.Expect("r2", []Expected{{"t3", "h3"}}, base))
		tb.OnEvent(Event{Shard: 0, TransferID: "t1", MMHash: "h1", Ready: true}, base)
		tb.OnEvent(Event{Shard: 1, TransferID: "t1", MMHash: "h1", Ready: true}, base)
		tb.OnEvent(Event{Shard: 0, TransferID: "t9", MMHash: "h9", Ready: true}, base)
		tb.Finish("r2", base)
		require.Equal(t, []string{"t3"}, tb.Ready(base).Cancels)
		require.NoError(t, tb.CheckInvariants())
		return tb
	}
	corruptions := map[string]func(tb *Table){
		"illegal move":             func(tb *Table) { tb.move(tb.records["t1"], Ready, base, "") },
		"terminal live record":     func(tb *Table) { tb.records["t1"].state = Failed },
		"shard out of range":       func(tb *Table) { tb.records["t2"].shards.add(5) },
		"available, shard missing": func(tb *Table) { tb.records["t1"].shards[0] = 1 },
		"waiting, every shard":     func(tb *Table) { tb.records["t2"].shards[0] = 3 },
		"missing deadline":         func(tb *Table) { tb.clearDeadline(tb.records["t2"]) },
		"deadline not in heap":     func(tb *Table) { tb.records["t2"].seq = 999 },
		"hash index lost":          func(tb *Table) { delete(tb.byHash, "h1") },
		"hash index stale":         func(tb *Table) { tb.byHash["h3"] = []*record{{id: "t3", hash: "h3"}} },
		"unknown request attached": func(tb *Table) { tb.records["t1"].requests = append(tb.records["t1"].requests, "r9") },
		"item lost":                func(tb *Table) { tb.records["t2"].requests = nil },
		"item failed and live":     func(tb *Table) { tb.requests["r1"].failed["t1"] = Failure{} },
		"live and tombstone":       func(tb *Table) { tb.tombs["t1"] = tombstone{state: Cancelled} },
		"tombstone not queued":     func(tb *Table) { tb.tombs["t8"] = tombstone{state: Cancelled} },
		"early for a live record":  func(tb *Table) { tb.early["t1"] = tb.early["t9"] },
		"early not queued":         func(tb *Table) { tb.earlyQ = nil },
		"wanted content uncounted": func(tb *Table) { delete(tb.askers, "h1") },
		"wanted content miscount":  func(tb *Table) { tb.askers["h2"]["r9"] = struct{}{} },
		"unwanted content counted": func(tb *Table) { tb.askers["h9"] = map[string]struct{}{"r1": {}} },
		"available for nobody": func(tb *Table) {
			// served without being loaded, and nobody else wants h1
			tb.records["t1"].requests = nil
			tb.requests["r1"].served["t1"] = struct{}{}
			delete(tb.askers["h1"], "r1")
			if len(tb.askers["h1"]) == 0 {
				delete(tb.askers, "h1")
			}
		},
		"loaded with a request": func(tb *Table) {
			r := tb.records["t1"]
			r.state = Ready
			tb.clearDeadline(r)
		},
	}
	fsmtest.Corruptions(t, build, (*Table).CheckInvariants, ErrInvariant, corruptions)
}

func TestEarlyQueueIsCompacted(t *testing.T) {
	// An entry that stays at the front keeps the consumed ones behind it
	// from being popped; the queue must still not grow with the churn.
	tb := New(Config{Shards: 2})
	tb.OnEvent(Event{Shard: 0, TransferID: "first", MMHash: "h", Ready: true}, base)
	for i := 0; i < 1000; i++ {
		id := fmt.Sprint("t", i)
		tb.OnEvent(Event{Shard: 0, TransferID: id, MMHash: "h", Ready: true}, base)
		require.NoError(t, tb.Expect("r", []Expected{{id, "h"}}, base))
	}
	require.LessOrEqual(t, len(tb.earlyQ), 2*len(tb.early)+65)
	require.NoError(t, tb.CheckInvariants())
}

func TestWaitingListsOnlyOldWaitingTransfers(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tb := New(Config{Shards: 2, EventWait: time.Minute})
	require.NoError(t, tb.Expect("r1", []Expected{{TransferID: "old", MMHash: "h1"}}, t0))
	require.NoError(t, tb.Expect("r2", []Expected{{TransferID: "young", MMHash: "h2"}, {TransferID: "done", MMHash: "h3"}}, t0.Add(2*time.Second)))
	for shard := 0; shard < 2; shard++ {
		tb.OnEvent(Event{Shard: shard, TransferID: "done", MMHash: "h3", Ready: true, NBytes: 8}, t0.Add(2*time.Second))
	}
	require.Equal(t, []string{"old"}, tb.Waiting(t0.Add(2500*time.Millisecond), time.Second))
	require.ElementsMatch(t, []string{"old", "young"}, tb.Waiting(t0.Add(3*time.Second), time.Second))
	require.Empty(t, tb.Waiting(t0.Add(3*time.Second), time.Hour))
}

// A shard's message of 8 records is one step: every item becomes
// available at once, the request with them, and the table ends where
// applying the same events one by one leaves it (a failure and a gone
// record in the middle included).
func TestOnEventsAppliesAMessageInOneStep(t *testing.T) {
	var items []Expected
	var evs []Event
	for i := range 8 {
		id, h := fmt.Sprintf("t%d", i), fmt.Sprintf("h%d", i)
		items = append(items, Expected{id, h})
		evs = append(evs, Event{Shard: 0, TransferID: id, MMHash: h, Ready: true, NBytes: 64})
	}
	batched := New(Config{Shards: 1})
	require.NoError(t, batched.Expect("r1", items, base))
	batched.OnEvents(evs, base)
	ready, failed := batched.Ensure("r1", base)
	require.True(t, ready)
	require.Empty(t, failed)
	require.EqualValues(t, 1, batched.Stats().EventSteps, "one message, one step")
	require.Equal(t, 8, batched.Stats().Records[Available])

	mixed := append([]Event(nil), evs...)
	mixed[3] = Event{Shard: 0, TransferID: "t3", MMHash: "h3", Reason: "writer abandoned"}
	mixed = append(mixed, Event{Shard: 0, MMHash: "h5", Gone: true, Reason: "evicted"}, Event{Shard: 0, TransferID: "t9", MMHash: "h9", Ready: true, NBytes: 1})
	one, many := New(Config{Shards: 1}), New(Config{Shards: 1})
	for _, tb := range []*Table{one, many} {
		require.NoError(t, tb.Expect("r1", items, base))
	}
	one.OnEvents(mixed, base)
	for _, ev := range mixed {
		many.OnEvent(ev, base)
	}
	so, sm := one.Stats(), many.Stats()
	require.EqualValues(t, 1, so.EventSteps)
	require.EqualValues(t, len(mixed), sm.EventSteps)
	so.EventSteps, sm.EventSteps = 0, 0
	require.Equal(t, sm, so, "a message ends where its events one by one end")
	require.Equal(t, many.Generation(), one.Generation())
	require.Equal(t, many.Ready(base), one.Ready(base))
	for _, tb := range []*Table{one, many} {
		require.NoError(t, tb.CheckInvariants())
	}
}
