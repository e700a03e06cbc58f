package sched

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
	"github.com/stretchr/testify/require"
)

// base is the script clock's zero; "at 5s" sets the clock to base+5s.
var base = fsmtest.Base

// runScript drives a Table from a script (fsmtest.Script: at, next and
// stats lines, "-> want" expectations). CheckInvariants runs after every
// line. Its own commands:
//
//	expect R T=H ... [-> collision|invalid]
//	ready S T H [NBYTES]        shard S reports T ready
//	fail S T H REASON...        shard S reports T failed
//	gone S H [REASON...]        shard S's copy of H ended
//	state T -> STATE|none
//	has H -> yes|no
//	ensure R -> ready|wait|failed T,T
//	failures R -> T:REASON | T:REASON   ("final" marks a non-retryable one)
//	load H -> T|error
//	loaded T ok|fail [REASON...]
//	freed H
//	finish R -> T,T|-           Finish, then the cancels of Ready
//	cancels -> T,T|-            the cancels of Ready (the table's own: siblings of a load)
//	lost S                      shard S stopped answering
//	restarted S                 shard S came back as a new incarnation
//	tick -> R/T,R/T|-           the failures of Ready
//	reason R T -> REASON        the reason Failures gives for item T of R
//	gen -> same|changed         Generation against the last gen line (or New)
//
// Each of finish, cancels and tick takes a Ready and shows one half of
// it; the other half is held for the line that shows it, so a script
// reads each kind of effect where it expects it.
func runScript(t *testing.T, cfg Config, script string) *Table {
	t.Helper()
	tb := New(cfg)
	lastGen := tb.Generation()
	var held Effects
	take := func(now time.Time) {
		rd := tb.Ready(now)
		held.Cancels = append(held.Cancels, rd.Cancels...)
		held.Failures = append(held.Failures, rd.Failures...)
	}
	cancels := func() []string {
		out := held.Cancels
		held.Cancels = nil
		return out
	}
	s := &fsmtest.Script{
		Next:  tb.NextDeadline,
		Stats: func() map[string]string { return statsMap(tb.Stats()) },
		Check: tb.CheckInvariants,
	}
	s.Do = func(l fsmtest.Line) bool {
		a, now, where := l.Args, s.Now, l.Where
		switch l.Cmd {
		case "gen":
			l.NeedWant()
			gen := tb.Generation()
			require.Contains(t, []string{"same", "changed"}, l.Want, where)
			if l.Want == "same" {
				require.Equal(t, lastGen, gen, where)
			} else {
				require.Greater(t, gen, lastGen, where)
			}
			lastGen = gen
		case "expect":
			var items []Expected
			for _, kv := range a[1:] {
				tid, h, _ := strings.Cut(kv, "=")
				items = append(items, Expected{TransferID: tid, MMHash: h})
			}
			l.ExpectErr(tb.Expect(a[0], items, now), map[string]error{"collision": ErrCollision, "invalid": ErrInvalid})
		case "ready", "fail":
			ev := Event{Shard: l.Int(0), TransferID: a[1], MMHash: a[2], Ready: l.Cmd == "ready"}
			if ev.Ready && len(a) > 3 {
				ev.NBytes = l.Uint(3)
			}
			if !ev.Ready {
				ev.Reason = l.Rest(3)
			}
			tb.OnEvent(ev, now)
		case "gone":
			tb.OnEvent(Event{Shard: l.Int(0), MMHash: a[1], Reason: l.Rest(2), Gone: true}, now)
		case "state":
			got := "none"
			if s, ok := tb.Status(a[0]); ok {
				got = s.String()
			}
			l.Expect(got)
		case "has":
			l.Expect(fsmtest.YesNo(tb.Has(a[0])))
		case "ensure":
			l.NeedWant()
			ready, failed := tb.Ensure(a[0], now)
			got := "wait"
			switch {
			case len(failed) > 0:
				ids := make([]string, len(failed))
				for i, x := range failed {
					ids[i] = x.TransferID
				}
				got = "failed " + strings.Join(ids, ",")
			case ready:
				got = "ready"
			}
			require.False(t, ready && len(failed) > 0, "%s: ready with failures", where)
			l.Expect(got)
		case "failures":
			var parts []string
			for _, x := range tb.Failures(a[0]) {
				p := x.TransferID + ":" + x.Reason
				if !x.Retryable {
					p += " final"
				}
				parts = append(parts, p)
			}
			l.Expect(strings.Join(parts, " | "))
		case "reason":
			got := "none"
			for _, x := range tb.Failures(a[0]) {
				if x.TransferID == a[1] {
					got = x.Reason
				}
			}
			l.Expect(got)
		case "load":
			l.NeedWant()
			id, err := tb.StartLoad(a[0], now)
			got := id
			if err != nil {
				require.ErrorIs(t, err, ErrNotAvailable, where)
				require.Empty(t, id, where)
				got = "error"
			}
			l.Expect(got)
		case "loaded":
			tb.Loaded(a[0], a[1] == "ok", l.Rest(2), now)
		case "freed":
			tb.Freed(a[0], now)
		case "finish":
			tb.Finish(a[0], now)
			take(now)
			l.Expect(orDash(cancels()))
		case "lost", "restarted":
			shard := l.Int(0)
			if l.Cmd == "lost" {
				tb.ShardLost(shard, fmt.Sprintf("shard %d lost", shard), now)
			} else {
				tb.ShardRestarted(shard, fmt.Sprintf("shard %d restarted", shard), now)
			}
		case "cancels":
			take(now)
			l.Expect(orDash(cancels()))
		case "tick":
			l.NeedWant()
			var got []string
			take(now)
			fails := held.Failures
			held.Failures = nil
			for _, x := range fails {
				require.True(t, x.Retryable || strings.Contains(x.Reason, "already ended"), where)
				got = append(got, x.RequestID+"/"+x.TransferID)
			}
			l.Expect(orDash(got))
		default:
			return false
		}
		return true
	}
	s.Run(t, script)
	return tb
}

var orDash = fsmtest.OrDash

func statsMap(s Stats) map[string]string {
	m := map[string]string{
		"requests":   strconv.Itoa(s.Requests),
		"early":      strconv.Itoa(s.EarlyEvents),
		"dropped":    strconv.FormatUint(s.EarlyDropped, 10),
		"ignored":    strconv.FormatUint(s.IgnoredEvents, 10),
		"reports":    strconv.FormatUint(s.IgnoredReports, 10),
		"collisions": strconv.FormatUint(s.Collisions, 10),
		"tombs":      strconv.Itoa(s.Tombstones),
	}
	m["live"] = orDash(fsmtest.Counts(s.Records))
	m["ended"] = orDash(fsmtest.Counts(s.Ended))
	return m
}
