package push

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
)

// cancelOneOfTwo starts a script: two pushes of one content to one shard,
// their reservations out and unanswered, and the first cancelled.
const cancelOneOfTwo = `
	add t1 h1 100 d1
	add t2 h1 100 d1
	ready -> reserve d1:t1,t2
	cancel t1
`

// followedThenCancelled starts the scenarios of a late follower: t2
// follows t1's write to d1, and t1's request goes away before its encoder
// output exists, so t1 waits for a source on t2's behalf.
const followedThenCancelled = `
	add t1 h1 100 d1
	add t2 h1 100 d1
	ready -> reserve d1:t1,t2
	grant t1 d1 write 1
	grant t2 d1 follow
	cancel t1
	ready -> done t2
`

// reserveOutAtDeadline starts the scenarios of a write whose wait for its
// source (60 s) runs out while another push's reservation of its content
// to the same shard is out: t3 reserves at 59 s, its answer due by 89 s.
const reserveOutAtDeadline = `
	add t1 h1 100 d1
	ready -> reserve d1:t1
	grant t1 d1 write 1
	at 59s
	add t3 h1 100 d1
	ready -> reserve d1:t3
`

// toWriting starts many scenarios: one push of t1 (content h1, 100 bytes)
// to d1, granted a region and handed out for writing.
const toWriting = `
	add t1 h1 100 d1
	ready -> reserve d1:t1
	grant t1 d1 write 1
	source h1 11 100
	ready -> write d1:t1@s11
`

func TestScenarios(t *testing.T) {
	cases := []struct {
		name   string
		cfg    Config
		script string
	}{
		{"one push to two shards through to done", Config{}, `
			add t1 h1 100 d1,d2
			pending -> yes
			state t1 -> d1=Reserving d2=Reserving
			ready -> reserve d1:t1 d2:t1
			ready -> -
			grant t1 d1 write 1
			grant t1 d2 write 2
			state t1 -> d1=WaitingInputs d2=WaitingInputs
			ready -> -
			source h1 11 100
			ready -> write d1:t1@s11 d2:t1@s11
			state t1 -> d1=Writing d2=Writing
			stats -> inflight=2 sources=1
			wrote t1 d1
			ready -> complete d1:t1
			wrote t1 d2
			ready -> complete d2:t1 | release s11
			completed t1 d1
			state t1 -> d1=Done d2=Notifying
			ready -> -
			completed t1 d2
			ready -> done t1
			state t1 -> d1=Done d2=Done
			pending -> no
			stats -> transfers=0 tombs=1 sources=0 ended=Done:2
		`},
		{"a write completed in-band ends Done with no complete to send", Config{}, toWriting + `
			landed t1 d1
			state t1 -> d1=Done
			ready -> release s11 | done t1
			pending -> no
			stats -> transfers=0 tombs=1 sources=0 ended=Done:1
		`},
		{"a write completed in-band that failed fails its push and gives the region up", Config{}, toWriting + `
			landed t1 d1 connection lost
			state t1 -> d1=Failed
			ready -> cancel d1:t1 | release s11 | fail t1/d1=write failed: connection lost
		`},
		{"a write cancelled in flight and completed in-band ends Cancelled", Config{}, toWriting + `
			cancel t1
			state t1 -> d1=CancelPending
			landed t1 d1
			state t1 -> d1=Cancelled
			stats -> ended=Cancelled:1
		`},
		{"an in-band report for no write in flight is ignored", Config{}, toWriting + `
			landed t1 d1
			landed t1 d1
			stats -> ignored=1
		`},
		{"source before the grant is written when the grant comes", Config{}, `
			add t1 h1 100 d1
			source h1 11 100
			ready -> reserve d1:t1
			grant t1 d1 write 1
			ready -> write d1:t1@s11
		`},
		{"follow and cached grants need no source", Config{}, `
			add t1 h1 100 d1,d2
			ready -> reserve d1:t1 d2:t1
			grant t1 d1 follow
			grant t1 d2 cached
			ready -> done t1
			pending -> no
			source h1 11 100
			pending -> yes
			ready -> release s11
			pending -> no
		`},
		{"a source is held while a grant may still ask for it", Config{}, `
			add t1 h1 100 d1
			source h1 11 100
			ready -> reserve d1:t1
			ready -> -
			grant t1 d1 follow
			ready -> release s11 | done t1
		`},
		{"same content in two transfers shares one source", Config{}, `
			add t1 h1 100 d1
			add t2 h1 100 d2
			ready -> reserve d1:t1 d2:t2
			grant t1 d1 write 1
			grant t2 d2 write 2
			source h1 11 100
			ready -> write d1:t1@s11 d2:t2@s11
			wrote t1 d1
			ready -> complete d1:t1
			completed t1 d1
			ready -> done t1
			stats -> sources=1
			wrote t2 d2
			ready -> complete d2:t2 | release s11
			completed t2 d2
			ready -> done t2
		`},
		{"shared source outlives the first write while a second push waits for its grant", Config{}, `
			add t1 h1 100 d1
			add t2 h1 100 d2
			ready -> reserve d1:t1 d2:t2
			grant t1 d1 write 1
			source h1 11 100
			ready -> write d1:t1@s11
			wrote t1 d1
			ready -> complete d1:t1
			stats -> sources=1
			grant t2 d2 write 2
			ready -> write d2:t2@s11
			wrote t2 d2
			ready -> complete d2:t2 | release s11
		`},
		{"a second source for held content is released at once", Config{}, `
			add t1 h1 100 d1
			source h1 11 100
			source h1 11 100
			source h1 12 100
			source h1 11 99 -> sizemismatch
			ready -> reserve d1:t1 | release s12
			stats -> sources=1
		`},
		{"cancel before the reserve went out", Config{}, `
			add t1 h1 100 d1,d2
			cancel t1
			state t1 -> d1=Cancelled d2=Cancelled
			ready -> -
			pending -> no
			stats -> ended=Cancelled:2
		`},
		{"cancel before the grant: a late grant is cancelled once", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			cancel t1
			state t1 -> d1=Cancelled
			grant t1 d1 write 7
			ready -> cancel d1:t1
			grant t1 d1 write 7
			ready -> -
			stats -> ignored=1
		`},
		{"cancel after the grant", Config{}, `
			add t1 h1 100 d1,d2
			ready -> reserve d1:t1 d2:t1
			grant t1 d1 write 1
			grant t1 d2 follow
			cancel t1
			state t1 -> d1=Cancelled d2=Done
			ready -> cancel d1:t1
			source h1 11 100
			ready -> release s11
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"cancel spares a write that another push of the content follows", Config{}, `
			add t1 h1 100 d1,d2
			add t2 h1 100 d1,d2
			ready -> reserve d1:t1,t2 d2:t1,t2
			grant t1 d1 write 1
			grant t1 d2 write 2
			grant t2 d1 follow
			grant t2 d2 follow
			state t2 -> d1=Done d2=Done
			cancel t1
			state t1 -> d1=WaitingInputs d2=WaitingInputs
			ready -> done t2
			source h1 11 100
			ready -> write d1:t1@s11 d2:t1@s11
			wrote t1 d1
			wrote t1 d2
			ready -> complete d1:t1 d2:t1 | release s11
			completed t1 d1
			completed t1 d2
			ready -> done t1
			pending -> no
		`},
		{"cancel spares a write that a push still reserving may follow", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			add t2 h1 100 d1
			cancel t1
			state t1 -> d1=WaitingInputs
			ready -> reserve d1:t2
			grant t2 d1 follow
			source h1 11 100
			ready -> write d1:t1@s11 | done t2
		`},
		{"cancel before the grants spares the write that the other push follows", Config{}, `
			# The shard granted t1 a write and made t2 follow it, but the
			# producer cancels t1 before either grant arrives: t1 must not
			# give its region up, or the shard fails t2.
			add t1 h1 100 d1,d2
			add t2 h1 100 d1,d2
			ready -> reserve d1:t1,t2 d2:t1,t2
			cancel t1
			state t1 -> d1=Reserving d2=Reserving
			grant t1 d1 write 1
			grant t2 d1 follow
			grant t1 d2 write 2
			grant t2 d2 follow
			state t1 -> d1=WaitingInputs d2=WaitingInputs
			ready -> done t2
			source h1 11 100
			ready -> write d1:t1@s11 d2:t1@s11
		`},
		{"a follow that arrives before its writer's grant spares that writer", Config{}, `
			# Two batches to one shard whose replies come back out of order.
			add t1 h1 100 d1
			ready -> reserve d1:t1
			add t2 h1 100 d1
			ready -> reserve d1:t2
			grant t2 d1 follow
			cancel t1
			state t1 -> d1=Reserving
			grant t1 d1 write 1
			state t1 -> d1=WaitingInputs
			ready -> done t2
			source h1 11 100
			ready -> write d1:t1@s11
		`},
		{"a deferred cancel ends when the other push is not made to follow", Config{}, cancelOneOfTwo + `
			grant t1 d1 write 1
			state t1 -> d1=WaitingInputs
			grant t2 d1 cached
			state t1 -> d1=Cancelled
			ready -> cancel d1:t1 | done t2
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"a deferred cancel whose own grant is a follow ends cancelled", Config{}, cancelOneOfTwo + `
			grant t1 d1 follow 5
			state t1 -> d1=Cancelled
			ready -> cancel d1:t1
			grant t2 d1 write 2
			state t2 -> d1=WaitingInputs
		`},
		{"both pushes cancelled before their grants: the shared write is cancelled", Config{}, cancelOneOfTwo + `
			state t1 -> d1=Reserving
			cancel t2
			state t1 -> d1=Cancelled
			state t2 -> d1=Cancelled
			grant t1 d1 write 1
			grant t2 d1 follow 2
			ready -> cancel d1:t1,t2
			pending -> yes
			cancelled t1 d1
			cancelled t2 d1
			pending -> no
		`},
		{"a cancel that waited for a push since cancelled takes effect", Config{}, `
			# t2 follows t1 (its grant came first, t1's is still out), so t1
			# goes on when cancelled. t3 reserves after that follow and is
			# cancelled while t1 still reserves: t3 waits, since t1 may be
			# the write t3 follows. Cancelling t1 removes the last push t3
			# could follow, so t3's cancel must take effect then.
			add t1 h1 100 d1
			ready -> reserve d1:t1
			add t2 h1 100 d1
			ready -> reserve d1:t2
			grant t2 d1 follow
			add t3 h1 100 d1
			ready -> reserve d1:t3 | done t2
			cancel t3
			state t3 -> d1=Reserving
			cancel t1
			state t1 -> d1=Reserving
			state t3 -> d1=Cancelled
			grant t1 d1 write 1
			grant t3 d1 follow 3
			ready -> cancel d1:t3
		`},
		{"a deferred cancel still fails at the reservation deadline", Config{}, cancelOneOfTwo + `
			at 31s
			ready -> fail t1/d1=Reserving: no reservation grant within 30s; t2/d1=Reserving: no reservation grant within 30s
			pending -> no
		`},
		{"a followed write that gets no source fails at its deadline", Config{}, followedThenCancelled + `
			stats -> extended=0
			at 61s
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
			stats -> extended=0
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"a push that joins a waiting write late gives that write the push's own wait for the source", Config{}, followedThenCancelled + `
			# At 50 s a third push of the content (t2's request retried)
			# follows t1's region too: its request will hand the content's
			# source over, and t1 writes it for both. Failing t1 at its own
			# deadline (60 s) would make the shard fail t3 with it.
			at 50s
			add t3 h1 100 d1
			ready -> reserve d1:t3
			grant t3 d1 follow
			ready -> done t3
			at 61s
			ready -> -
			state t1 -> d1=WaitingInputs
			stats -> extended=0
			source h1 7 100
			ready -> write d1:t1@s7
			stats -> extended=1
			wrote t1 d1
			ready -> complete d1:t1 | release s7
			completed t1 d1
			ready -> done t1
			pending -> no
		`},
		{"a late follower's wait is bounded: with no source the write still fails", Config{}, followedThenCancelled + `
			at 50s
			add t3 h1 100 d1
			ready -> reserve d1:t3
			grant t3 d1 follow
			ready -> done t3
			at 109s
			ready -> -
			at 110s
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
		`},
		{"a write whose wait ran out while another push's reservation is out waits for that answer", Config{}, followedThenCancelled + `
			# t3's reservation is out when t1's wait ends: the shard may have
			# made t3 follow t1's write already, so t1 waits for t3's answer.
			# A follow gives t1 t3's own wait for the source.
			at 59s
			add t3 h1 100 d1
			ready -> reserve d1:t3
			at 60s
			ready -> -
			state t1 -> d1=WaitingInputs
			at 61s
			grant t3 d1 follow
			ready -> done t3
			at 120s
			ready -> -
			stats -> extended=0
			at 121s
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
			stats -> extended=1
		`},
		{"a write whose wait ran out fails once the awaited answer shows nobody follows it", Config{}, reserveOutAtDeadline + `
			at 60s
			ready -> -
			at 61s
			grant t3 d1 write 3
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
			state t3 -> d1=WaitingInputs
		`},
		{"a write whose wait ran out fails when the awaited answer never comes", Config{}, reserveOutAtDeadline + `
			at 88s
			ready -> -
			at 89s
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s; t3/d1=Reserving: no reservation grant within 30s
		`},
		{"an overdue write stops waiting for a reservation whose push is cancelled", Config{}, reserveOutAtDeadline + `
			# t3's cancel waits (t4 may still come to follow t3), but t1 no
			# longer waits for t3: t3's request is gone, so it does not
			# matter that t3 fails with t1's region.
			at 60s
			ready -> -
			add t4 h1 100 d1
			cancel t3
			state t3 -> d1=Reserving
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
			cancelled t1 d1
			ready -> reserve d1:t4
		`},
		{"a reserve waits until the shard has heard the abandon of its content's region", Config{}, `
			# Nobody else wants h1 on d1 when t1 is cancelled, so its region
			# is given up. t2 shows the same image before the shard has heard
			# that: a reserve overtaking the abandon would be made to follow
			# the region being given up, and fail with it.
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			cancel t1
			add t2 h1 100 d1,d2
			ready -> reserve d2:t2 | cancel d1:t1
			ready -> -
			pending -> yes
			cancelled t1 d1
			ready -> reserve d1:t2
			grant t2 d1 write 2
			grant t2 d2 write 3
			source h1 11 100
			ready -> write d1:t2@s11 d2:t2@s11
		`},
		{"a reserve waits while a cancelled write of its content to that shard is still in flight", Config{}, toWriting + `
			# t1 is cancelled mid-write with nobody following: once the write
			# ends, its region is given up, so t2 must not be made to follow it.
			cancel t1
			add t2 h1 100 d1
			ready -> -
			wrote t1 d1
			ready -> cancel d1:t1
			cancelled t1 d1
			ready -> reserve d1:t2
			grant t2 d1 write 2
			ready -> write d1:t2@s11
		`},
		{"a reserve asked while the abandon is out waits for its answer", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			cancel t1
			ready -> cancel d1:t1
			add t2 h1 100 d1
			add t3 h2 100 d1
			ready -> reserve d1:t3
			cancelled t1 d1
			cancelled t1 d1
			stats -> ignored=1
			ready -> reserve d1:t2
		`},
		{"a grant that comes after its push ended holds the content's reserves back too", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			at 30s
			tick
			add t2 h1 100 d1
			grant t1 d1 write 7
			ready -> cancel d1:t1 | fail t1/d1=Reserving: no reservation grant within 30s
			cancelled t1 d1
			ready -> reserve d1:t2
		`},
		{"a reserve waits for the answer to a cancelled push's reservation still out", Config{}, `
			# t1 is cancelled while its reserve is out: the shard may already
			# have given it a region, which the Cancel sent with its late grant
			# gives up. t2, sent before that grant came back, would be made to
			# follow that region and fail with it.
			add t1 h1 100 d1
			ready -> reserve d1:t1
			cancel t1
			state t1 -> d1=Cancelled
			add t2 h1 100 d1
			add t3 h2 100 d1
			ready -> reserve d1:t3
			grant t1 d1 write 1
			ready -> cancel d1:t1
			cancelled t1 d1
			ready -> reserve d1:t2
			grant t2 d1 write 2
			state t2 -> d1=WaitingInputs
		`},
		{"an answer with no region to give up lets the held reserve go at once", Config{}, `
			add t1 h1 100 d1,d2
			ready -> reserve d1:t1 d2:t1
			cancel t1
			add t2 h1 100 d1,d2
			ready -> -
			stats -> unanswered=2
			grant t1 d1 err pool full
			ready -> reserve d1:t2
			grant t1 d2 follow
			ready -> reserve d2:t2
			stats -> cancelsout=0 unanswered=0
		`},
		{"a reserve waits for the late grant of a push that failed at its deadline", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			at 30s
			add t2 h1 100 d1
			ready -> fail t1/d1=Reserving: no reservation grant within 30s
			grant t1 d1 write 7
			ready -> cancel d1:t1
			cancelled t1 d1
			ready -> reserve d1:t2
		`},
		{"a forgotten push no longer holds its content's reserves", Config{MaxTombstones: 1}, `
			# Once t1's tombstone is gone no grant can find it, so the hold it
			# kept ends with it.
			add t1 h1 100 d1
			ready -> reserve d1:t1
			cancel t1
			add t2 h1 100 d1
			add t3 h2 100 d1
			ready -> reserve d1:t3
			grant t3 d1 cached
			ready -> reserve d1:t2 | done t3
		`},
		{"a held reserve still fails at its deadline if the abandon is never answered", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			cancel t1
			add t2 h1 100 d1
			ready -> cancel d1:t1
			at 30s
			ready -> fail t2/d1=Reserving: no reservation grant within 30s
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"cancel during the write holds the source until the write ends", Config{}, toWriting + `
			cancel t1
			state t1 -> d1=CancelPending
			ready -> -
			stats -> sources=1 inflight=1
			pending -> yes
			wrote t1 d1
			state t1 -> d1=Cancelled
			ready -> cancel d1:t1 | release s11
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"cancel once the bytes landed lets the push complete", Config{}, toWriting + `
			wrote t1 d1
			cancel t1
			ready -> complete d1:t1 | release s11
			completed t1 d1
			ready -> done t1
		`},
		{"reserve deadline", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			next -> 30s
			at 29.999999999s
			tick
			state t1 -> d1=Reserving
			at 30s
			tick
			state t1 -> d1=Failed
			ready -> fail t1/d1=Reserving: no reservation grant within 30s
			grant t1 d1 write 5
			ready -> cancel d1:t1
		`},
		{"source deadline", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			at 1s
			grant t1 d1 write 1
			next -> 1m1s
			at 60.999s
			ready -> -
			at 61s
			ready -> cancel d1:t1 | fail t1/d1=WaitingInputs: no encoder output within 60s
			source h1 11 100
			ready -> release s11
		`},
		{"write deadline fails the record but the source waits for the write", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			source h1 11 100
			at 5s
			ready -> write d1:t1@s11
			next -> 1m5s
			at 65s
			ready -> cancel d1:t1 | fail t1/d1=Writing: write not finished within 60s
			state t1 -> d1=Failed
			stats -> sources=1 inflight=1 transfers=1
			pending -> yes
			next -> none
			wrote t1 d1
			ready -> release s11
			pending -> yes
			cancelled t1 d1
			pending -> no
			stats -> transfers=0 tombs=1
		`},
		{"complete deadline", Config{}, toWriting + `
			at 10s
			wrote t1 d1
			ready -> complete d1:t1 | release s11
			at 39.9s
			tick
			state t1 -> d1=Notifying
			at 40s
			ready -> cancel d1:t1 | fail t1/d1=Notifying: complete not acknowledged within 30s
			completed t1 d1
			stats -> ignored=1
		`},
		{"cancel-pending deadline keeps the write's deadline", Config{}, toWriting + `
			at 10s
			cancel t1
			next -> 1m0s
			at 60s
			ready -> cancel d1:t1 | fail t1/d1=CancelPending: cancelled write not finished within 60s
			stats -> sources=1
			wrote t1 d1
			ready -> release s11
		`},
		{"write error", Config{}, `
			add t1 h1 100 d1,d2
			ready -> reserve d1:t1 d2:t1
			grant t1 d1 write 1
			grant t1 d2 write 2
			source h1 11 100
			ready -> write d1:t1@s11 d2:t1@s11
			wrote t1 d1 connection reset
			ready -> cancel d1:t1 | fail t1/d1=write failed: connection reset
			wrote t1 d2
			ready -> complete d2:t1 | release s11
			completed t1 d2
			ready -> -
			state t1 -> d1=Failed d2=Done
			pending -> yes
			cancelled t1 d1
			pending -> no
		`},
		{"complete error", Config{}, toWriting + `
			wrote t1 d1
			ready -> complete d1:t1 | release s11
			completed t1 d1 shard restarted
			ready -> cancel d1:t1 | fail t1/d1=complete failed: shard restarted
		`},
		{"the source is released once the bytes landed, while the complete is unacknowledged", Config{}, toWriting + `
			wrote t1 d1
			ready -> complete d1:t1 | release s11
			state t1 -> d1=Notifying
			stats -> sources=0 completesout=1 inflight=0
			pending -> yes
			completed t1 d1
			ready -> done t1
			stats -> completesout=0 completesfailed=0
			pending -> no
		`},
		{"a complete refused after its source was released fails the push, counted, and gives the region up", Config{}, toWriting + `
			wrote t1 d1
			ready -> complete d1:t1 | release s11
			stats -> sources=0 completesout=1
			completed t1 d1 complete at d1: reserve: bad token
			ready -> cancel d1:t1 | fail t1/d1=complete failed: complete at d1: reserve: bad token
			stats -> completesout=0 completesfailed=1 ended=Failed:1 sources=0 cancelsout=1
			cancelled t1 d1
			pending -> no
		`},
		{"completes beyond the window wait for an acknowledgement, per shard", Config{CompleteWindow: 2}, `
			add t1 h1 100 d1
			add t2 h2 100 d1
			add t3 h3 100 d1
			add t4 h4 100 d2
			ready -> reserve d1:t1,t2,t3 d2:t4
			grant t1 d1 write 1
			grant t2 d1 write 2
			grant t3 d1 write 3
			grant t4 d2 write 4
			source h1 11 100
			source h2 12 100
			source h3 13 100
			source h4 14 100
			ready -> write d1:t1@s11,t2@s12,t3@s13 d2:t4@s14
			wrote t1 d1
			wrote t2 d1
			wrote t3 d1
			wrote t4 d2
			ready -> complete d1:t1,t2 d2:t4 | release s11,s12,s13,s14
			stats -> completesout=3 windowwaits=1 sources=0
			state t3 -> d1=Notifying
			ready -> -
			stats -> windowwaits=1
			completed t2 d1
			ready -> complete d1:t3 | done t2
			stats -> completesout=3 windowwaits=1
			completed t1 d1
			completed t3 d1
			completed t4 d2
			ready -> done t1,t3,t4
			stats -> completesout=0
			pending -> no
		`},
		{"a complete held at the window keeps its deadline; one failed at its deadline frees its place", Config{CompleteWindow: 1, NotifyWait: 5 * time.Second}, `
			add t1 h1 100 d1
			add t2 h2 100 d1
			add t3 h3 100 d1
			ready -> reserve d1:t1,t2,t3
			grant t1 d1 write 1
			grant t2 d1 write 2
			grant t3 d1 write 3
			source h1 11 100
			source h2 12 100
			source h3 13 100
			ready -> write d1:t1@s11,t2@s12,t3@s13
			wrote t1 d1
			ready -> complete d1:t1 | release s11
			at 3s
			wrote t2 d1
			wrote t3 d1
			ready -> release s12,s13
			stats -> completesout=1 windowwaits=2
			at 5s
			ready -> complete d1:t2 | cancel d1:t1 | fail t1/d1=Notifying: complete not acknowledged within 5s
			completed t1 d1
			stats -> ignored=1 completesout=1
			at 8s
			ready -> cancel d1:t2,t3 | fail t2/d1=Notifying: complete not acknowledged within 5s; t3/d1=Notifying: complete not acknowledged within 5s
			stats -> completesout=0 completesfailed=0 ended=Failed:3
		`},
		{"refused and malformed grants", Config{}, `
			add t1 h1 100 d1,d2,d3,d4
			ready -> reserve d1:t1 d2:t1 d3:t1 d4:t1
			grant t1 d1 err pool full
			grant t1 d2 write 2 64
			grant t1 d3 write 0
			grant t1 d4 teleport 4
			ready -> cancel d2:t1 d4:t1 | fail t1/d1=reserve refused: pool full; t1/d2=granted 64 bytes for a 100-byte push; t1/d3=write grant without reservation id or token; t1/d4=unknown grant kind "teleport"
		`},
		{"size mismatch fails the pushes of the content", Config{}, `
			add t1 h1 100 d1
			add t2 h1 100 d2
			ready -> reserve d1:t1 d2:t2
			grant t1 d1 write 1
			source h1 11 99 -> sizemismatch
			ready -> cancel d1:t1 | fail t1/d1=encoder output is 99 bytes, push announced 100; t2/d2=encoder output is 99 bytes, push announced 100
			stats -> sources=0
			grant t2 d2 write 2
			ready -> cancel d2:t2
		`},
		{"collision refused for that push only", Config{}, `
			add t1 h1 100 d1,d2
			add t1 h1 100 d2,d1
			add t1 h1 100 d1 -> collision
			add t1 h2 100 d1,d2 -> collision
			add t1 h1 200 d1,d2 -> collision
			add t2 h1 200 d3 -> collision
			stats -> collisions=4 transfers=1
			ready -> reserve d1:t1 d2:t1
			state t2 -> none
		`},
		{"an ended push is remembered", Config{}, `
			add t1 h1 100 d1
			ready -> reserve d1:t1
			grant t1 d1 cached
			ready -> done t1
			add t1 h1 100 d1
			add t1 h1 100 d2 -> collision
			ready -> -
			state t1 -> d1=Done
		`},
		{"invalid input", Config{}, `
			add t1 h1 100 -> invalid
			add t1 h1 0 d1 -> invalid
			add t1 h1 100 d1,d1 -> invalid
			add t1 h1 100 d1,,d2 -> invalid
			source h1 0 100 -> invalid
			source h1 11 0 -> invalid
			pending -> no
		`},
		{"late and unknown reports are ignored", Config{}, `
			add t1 h1 100 d1
			grant t9 d1 write 1
			grant t1 d9 write 1
			wrote t1 d1
			completed t1 d1
			ready -> reserve d1:t1
			grant t1 d1 write 1
			grant t1 d1 write 1
			stats -> ignored=5
		`},
		{"tombstones are bounded", Config{MaxTombstones: 2}, `
			add t1 h1 100 d1
			add t2 h2 100 d1
			add t3 h3 100 d1
			cancel t1
			cancel t2
			cancel t3
			stats -> tombs=2 transfers=0
			state t1 -> none
			state t2 -> d1=Cancelled
			state t3 -> d1=Cancelled
		`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runScript(t, tc.cfg, tc.script) })
	}
}

func TestBatchingOneDestination(t *testing.T) {
	m := New(Config{})
	var want []string
	for i := 0; i < 10; i++ {
		id := fmt.Sprint("t", i)
		want = append(want, id)
		require.NoError(t, m.Add(Push{TransferID: id, MMHash: fmt.Sprint("h", i), NBytes: 100, Dests: []string{"d1"}}, base))
	}
	rd := m.Ready(base)
	require.Len(t, rd.Reserves, 1)
	require.Len(t, rd.Reserves["d1"], 10)
	for i, it := range rd.Reserves["d1"] {
		require.Equal(t, want[i], it.TransferID)
	}
	for i, id := range want {
		m.Granted(id, "d1", Grant{Kind: KindWrite, Res: ids.ResID(i + 1), Token: tokenFor(ids.ResID(i + 1)), NBytes: 100}, base)
		require.NoError(t, m.SourceReady(fmt.Sprint("h", i), SourceID(i+1), 100, base))
	}
	rd = m.Ready(base)
	require.Len(t, rd.Writes, 1)
	require.Len(t, rd.Writes["d1"], 10)
	for _, id := range want {
		m.WriteDone(id, "d1", nil, base)
	}
	rd = m.Ready(base)
	require.Len(t, rd.Completes, 1)
	require.Len(t, rd.Completes["d1"], 10)
	require.Len(t, rd.Releases, 10)
	require.NoError(t, m.CheckInvariants())
}

func TestAddErrorsNamePushes(t *testing.T) {
	m := New(Config{})
	require.NoError(t, m.Add(Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Dests: []string{"d1"}}, base))
	err := m.Add(Push{TransferID: "t1", MMHash: "h2", NBytes: 100, Dests: []string{"d1"}}, base)
	require.ErrorIs(t, err, ErrCollision)
	require.ErrorContains(t, err, "add t1 (mm_hash h2, 100 bytes, dests [d1])")
	require.ErrorContains(t, err, "already announced as t1 (mm_hash h1, 100 bytes, dests [d1])")
}

func TestAddCopiesDestinations(t *testing.T) {
	m := New(Config{})
	dests := []string{"d1", "d2"}
	require.NoError(t, m.Add(Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Dests: dests}, base))
	dests[0] = "dX"
	st, ok := m.Status("t1")
	require.True(t, ok)
	require.Contains(t, st, "d1")
	require.NoError(t, m.CheckInvariants())
}

func TestCheckInvariantsCatchesCorruption(t *testing.T) {
	build := func() *Manager {
		m := New(Config{MaxTombstones: 4})
		write := func(res ids.ResID) Grant {
			return Grant{Kind: KindWrite, Res: res, Token: tokenFor(res), NBytes: 100}
		}
		require.NoError(t, m.Add(Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Dests: []string{"d1", "d2"}}, base))
		require.NoError(t, m.Add(Push{TransferID: "t2", MMHash: "h2", NBytes: 100, Dests: []string{"d1"}}, base))
		require.NoError(t, m.Add(Push{TransferID: "t3", MMHash: "h3", NBytes: 100, Dests: []string{"d1"}}, base))
		m.Ready(base)
		m.Granted("t1", "d1", write(1), base)
		m.Granted("t1", "d2", write(2), base)
		m.Granted("t2", "d1", write(3), base)
		m.Granted("t3", "d1", Grant{Kind: KindCached}, base)
		require.NoError(t, m.SourceReady("h1", 1, 100, base))
		m.Ready(base) // t1 writing on both shards; t2 waits for its source
		require.NoError(t, m.CheckInvariants())
		return m
	}
	rec := func(m *Manager, tid string, i int) *rec { return m.transfers[tid].recs[i] }
	corruptions := map[string]func(m *Manager){
		"illegal move":                  func(m *Manager) { m.move(rec(m, "t2", 0), Done, base, "") },
		"source released under a write": func(m *Manager) { m.contents["h1"].src = 0; m.held-- },
		"write reads another source":    func(m *Manager) { rec(m, "t1", 0).src = 9 },
		"reader count":                  func(m *Manager) { m.contents["h1"].readers-- },
		"waiter count":                  func(m *Manager) { m.contents["h2"].waiters++ },
		"writing without a write":       func(m *Manager) { rec(m, "t1", 1).inFlight = false },
		"waiting with a write":          func(m *Manager) { rec(m, "t2", 0).inFlight = true },
		"no deadline":                   func(m *Manager) { rec(m, "t2", 0).seq = 0 },
		"grant lost":                    func(m *Manager) { rec(m, "t2", 0).hasGrant = false },
		"live count":                    func(m *Manager) { m.transfers["t2"].live = 2 },
		"finished but not retired": func(m *Manager) {
			r := rec(m, "t2", 0)
			r.state, r.seq = Cancelled, 0
			m.transfers["t2"].live = 0
			m.contents["h2"].waiters = 0
			m.liveRecs--
		},
		"content lists a dead transfer": func(m *Manager) {
			dead := &transfer{push: Push{TransferID: "t3", MMHash: "h2", NBytes: 100, Dests: []string{"d1"}}}
			m.contents["h2"].transfers = append(m.contents["h2"].transfers, dead)
		},
		"source held, write not queued": func(m *Manager) {
			m.contents["h2"].src, m.contents["h2"].srcBytes = 7, 100
			m.held++
		},
		"tombstone not queued":        func(m *Manager) { m.tombs.byKey[m.tombKey("t9")] = m.tombs.byKey[m.tombKey("t3")] },
		"both live and retired":       func(m *Manager) { m.tombs.byKey[m.tombKey("t2")] = m.tombs.byKey[m.tombKey("t3")] },
		"destination list miscounted": func(m *Manager) { m.tombs.dests.refs[m.tombs.byKey[m.tombKey("t3")].dests]++ },
		"tombstone states kept alone": func(m *Manager) { m.tombs.more[m.tombKey("t9")] = []State{Done} },
		"held count":                  func(m *Manager) { m.held++ },
		"cancel out not counted":      func(m *Manager) { m.cancelsOut[destTID{"d1", "t9"}] = "h1" },
		"complete out while writing": func(m *Manager) {
			rec(m, "t1", 0).completeOut = true
			m.completesOut["d1"]++
		},
		"window count":       func(m *Manager) { m.completesOut["d1"] = 1 },
		"complete forgotten": func(m *Manager) { m.WriteDone("t1", "d1", nil, base); m.completeQ = nil },
		"complete both queued and out": func(m *Manager) {
			m.WriteDone("t1", "d1", nil, base)
			rec(m, "t1", 0).completeOut = true
			m.completesOut["d1"]++
		},
		"window overrun": func(m *Manager) {
			m.WriteDone("t1", "d1", nil, base)
			m.Ready(base)
			m.cfg.CompleteWindow = 0
		},
		"source kept that no push needs": func(m *Manager) {
			m.contents["h9"] = &content{src: 9, srcBytes: 100}
			m.held++
		},
	}
	fsmtest.Corruptions(t, build, (*Manager).CheckInvariants, ErrInvariant, corruptions)
}

func TestDeadlineHeapStaysBounded(t *testing.T) {
	// A record that ends leaves its deadline entry behind; the heap must be
	// rebuilt rather than grow with the number of pushes.
	m := New(Config{})
	for i := 0; i < 500; i++ {
		id := fmt.Sprint("t", i)
		require.NoError(t, m.Add(Push{TransferID: id, MMHash: "h", NBytes: 100, Dests: []string{"d1"}}, base))
		m.Cancel(id, base)
	}
	require.LessOrEqual(t, len(m.deadlines), 2*m.liveRecs+64)
	require.NoError(t, m.CheckInvariants())
}

// A tombstone keeps the push's identity and its records' states, not the
// transfer: an ended push of two shards, announced again with its shards
// in the other order, is the same push; another size, meta, mm_hash or
// set of shards under its transfer_id is a collision. Only a transfer with
// a record still waiting for its reservation's answer stays whole, and
// that late answer still finds the record.
func TestTombstonesRememberIdentityNotTransfers(t *testing.T) {
	m := New(Config{})
	p := Push{TransferID: "t1", MMHash: "h1", NBytes: 100, Meta: "m", Dests: []string{"d1", "d2"}}
	require.NoError(t, m.Add(p, base))
	m.Ready(base)
	m.Granted("t1", "d1", Grant{Kind: KindCached}, base)
	m.Granted("t1", "d2", Grant{Kind: KindCached}, base)
	require.Len(t, m.Ready(base).Done, 1)
	require.Contains(t, m.tombs.byKey, m.tombKey("t1"))
	require.NotContains(t, m.tombs.full, m.tombKey("t1"), "an ended push with every record answered keeps no transfer")

	again := p
	again.Dests = []string{"d2", "d1"}
	require.NoError(t, m.Add(again, base))
	for _, other := range []Push{
		{TransferID: "t1", MMHash: "h1", NBytes: 200, Meta: "m", Dests: p.Dests},
		{TransferID: "t1", MMHash: "h1", NBytes: 100, Meta: "n", Dests: p.Dests},
		{TransferID: "t1", MMHash: "h2", NBytes: 100, Meta: "m", Dests: p.Dests},
		{TransferID: "t1", MMHash: "h1", NBytes: 100, Meta: "m", Dests: []string{"d1"}},
	} {
		require.ErrorIs(t, m.Add(other, base), ErrCollision, "%+v", other)
	}
	st, ok := m.Status("t1")
	require.True(t, ok)
	require.Equal(t, map[string]State{"d1": Done, "d2": Done}, st)

	// t2 is cancelled while its reservation is out: its tombstone keeps the
	// record, and the late grant is answered with a cancel of its region.
	require.NoError(t, m.Add(Push{TransferID: "t2", MMHash: "h2", NBytes: 100, Dests: []string{"d1"}}, base))
	m.Ready(base)
	m.Cancel("t2", base)
	m.Ready(base)
	require.Contains(t, m.tombs.full, m.tombKey("t2"), "a record waiting for its answer keeps its transfer")
	m.Granted("t2", "d1", Grant{Kind: KindWrite, Res: 7, Token: tokenFor(7), NBytes: 100}, base)
	require.Len(t, m.Ready(base).Cancels["d1"], 1, "the late region is given up")
	require.NoError(t, m.CheckInvariants())
}
