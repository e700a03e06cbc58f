package sched

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// base is the script clock's zero; "at 5s" sets the clock to base+5s.
var base = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// runScript drives a Table from a small line-oriented script, in the manner
// of Pebble's datadriven tests. Each line is a command, optionally followed
// by "-> want"; commands that return something must state what they expect.
// CheckInvariants runs after every line.
//
//	at D                        set the clock to base+D (a Go duration)
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
//	finish R -> T,T|-
//	cancels -> T,T|-            transfers the table cancelled on its own
//	lost S                      shard S stopped answering
//	restarted S                 shard S came back as a new incarnation
//	tick -> R/T,R/T|-
//	reason R T -> REASON        the reason Failures gives for item T of R
//	next -> D|none              NextDeadline as an offset from base
//	stats -> key=value ...      only the keys given are compared
//	gen -> same|changed         Generation against the last gen line (or New)
func runScript(t *testing.T, cfg Config, script string) *Table {
	t.Helper()
	tb := New(cfg)
	now := base
	lastGen := tb.Generation()
	for n, raw := range strings.Split(script, "\n") {
		line := strings.TrimSpace(raw)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		where := fmt.Sprintf("line %d: %s", n+1, line)
		cmd, want, hasWant := strings.Cut(line, "->")
		want = strings.TrimSpace(want)
		f := strings.Fields(cmd)
		needWant := func() {
			require.True(t, hasWant, "%s: command must state its expected result", where)
		}
		switch f[0] {
		case "gen":
			needWant()
			gen := tb.Generation()
			require.Contains(t, []string{"same", "changed"}, want, where)
			if want == "same" {
				require.Equal(t, lastGen, gen, where)
			} else {
				require.Greater(t, gen, lastGen, where)
			}
			lastGen = gen
		case "at":
			d, err := time.ParseDuration(f[1])
			require.NoError(t, err, where)
			now = base.Add(d)
		case "expect":
			var items []Expected
			for _, kv := range f[2:] {
				tid, h, _ := strings.Cut(kv, "=")
				items = append(items, Expected{TransferID: tid, MMHash: h})
			}
			err := tb.Expect(f[1], items, now)
			switch want {
			case "":
				require.NoError(t, err, where)
			case "collision":
				require.ErrorIs(t, err, ErrCollision, where)
			case "invalid":
				require.ErrorIs(t, err, ErrInvalid, where)
			default:
				t.Fatalf("%s: unknown expectation", where)
			}
		case "ready", "fail":
			shard, err := strconv.Atoi(f[1])
			require.NoError(t, err, where)
			ev := Event{Shard: shard, TransferID: f[2], MMHash: f[3], Ready: f[0] == "ready"}
			if ev.Ready && len(f) > 4 {
				ev.NBytes, err = strconv.ParseUint(f[4], 10, 64)
				require.NoError(t, err, where)
			}
			if !ev.Ready {
				ev.Reason = strings.Join(f[4:], " ")
			}
			tb.OnEvent(ev, now)
		case "gone":
			shard, err := strconv.Atoi(f[1])
			require.NoError(t, err, where)
			tb.OnEvent(Event{Shard: shard, MMHash: f[2], Reason: strings.Join(f[3:], " "), Gone: true}, now)
		case "state":
			needWant()
			got := "none"
			if s, ok := tb.Status(f[1]); ok {
				got = s.String()
			}
			require.Equal(t, want, got, where)
		case "has":
			needWant()
			require.Equal(t, want, map[bool]string{true: "yes", false: "no"}[tb.Has(f[1])], where)
		case "ensure":
			needWant()
			ready, failed := tb.Ensure(f[1], now)
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
			require.Equal(t, want, got, where)
		case "failures":
			needWant()
			var parts []string
			for _, x := range tb.Failures(f[1]) {
				p := x.TransferID + ":" + x.Reason
				if !x.Retryable {
					p += " final"
				}
				parts = append(parts, p)
			}
			require.Equal(t, want, strings.Join(parts, " | "), where)
		case "reason":
			needWant()
			got := "none"
			for _, x := range tb.Failures(f[1]) {
				if x.TransferID == f[2] {
					got = x.Reason
				}
			}
			require.Equal(t, want, got, where)
		case "load":
			needWant()
			id, err := tb.StartLoad(f[1], now)
			got := id
			if err != nil {
				require.ErrorIs(t, err, ErrNotAvailable, where)
				require.Empty(t, id, where)
				got = "error"
			}
			require.Equal(t, want, got, where)
		case "loaded":
			tb.Loaded(f[1], f[2] == "ok", strings.Join(f[3:], " "), now)
		case "freed":
			tb.Freed(f[1], now)
		case "finish":
			needWant()
			require.Equal(t, want, orDash(tb.Finish(f[1], now)), where)
		case "lost", "restarted":
			shard, err := strconv.Atoi(f[1])
			require.NoError(t, err, where)
			if f[0] == "lost" {
				tb.ShardLost(shard, fmt.Sprintf("shard %d lost", shard), now)
			} else {
				tb.ShardRestarted(shard, fmt.Sprintf("shard %d restarted", shard), now)
			}
		case "cancels":
			needWant()
			require.Equal(t, want, orDash(tb.Cancels()), where)
		case "tick":
			needWant()
			var got []string
			for _, x := range tb.Tick(now) {
				require.True(t, x.Retryable || strings.Contains(x.Reason, "already ended"), where)
				got = append(got, x.RequestID+"/"+x.TransferID)
			}
			require.Equal(t, want, orDash(got), where)
		case "next":
			needWant()
			got := "none"
			if at, ok := tb.NextDeadline(); ok {
				got = at.Sub(base).String()
			}
			require.Equal(t, want, got, where)
		case "stats":
			needWant()
			got := statsMap(tb.Stats())
			for _, kv := range strings.Fields(want) {
				k, v, _ := strings.Cut(kv, "=")
				gv, ok := got[k]
				require.True(t, ok, "%s: unknown stat %s", where, k)
				require.Equal(t, v, gv, "%s: stat %s", where, k)
			}
		default:
			t.Fatalf("%s: unknown command", where)
		}
		require.NoError(t, tb.CheckInvariants(), where)
	}
	return tb
}

func orDash(list []string) string {
	if len(list) == 0 {
		return "-"
	}
	return strings.Join(list, ",")
}

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
	var live, ended []string
	for st, n := range s.Records {
		live = append(live, fmt.Sprintf("%s:%d", st, n))
	}
	for st, n := range s.Ended {
		ended = append(ended, fmt.Sprintf("%s:%d", st, n))
	}
	sort.Strings(live)
	sort.Strings(ended)
	m["live"] = orDash(live)
	m["ended"] = orDash(ended)
	return m
}
