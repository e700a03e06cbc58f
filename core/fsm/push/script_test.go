package push

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

// base is the script clock's zero; "at 5s" sets the clock to base+5s.
var base = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// tokenFor derives a recognisable token from a reservation id.
func tokenFor(res ids.ResID) ids.Token {
	var tok ids.Token
	if res != 0 {
		for i := range tok {
			tok[i] = byte(res)
		}
	}
	return tok
}

// runScript drives a Manager from a small line-oriented script, in the
// manner of Pebble's datadriven tests. Each line is a command, optionally
// followed by "-> want"; commands that return something must state what
// they expect. CheckInvariants runs after every line.
//
//	at D                              set the clock to base+D (a Go duration)
//	add T H N D1,D2 [-> collision|invalid]
//	grant T D write RES [NBYTES]      token derived from RES; NBYTES defaults to the push's
//	grant T D follow|cached [RES]
//	grant T D err REASON...
//	grant T D KIND                    any other kind
//	source H SRC N [-> sizemismatch|invalid]
//	wrote T D [ERR...]
//	completed T D [ERR...]
//	cancel T
//	tick
//	ready -> SECTION | SECTION ...    or "-" when empty; see formatReady
//	state T -> D=STATE ...|none
//	pending -> yes|no
//	next -> D|none
//	stats -> key=value ...            only the keys given are compared
//
// Every Write, Complete and Cancel that Ready returns must carry the
// reservation id and token of the grant given for its (transfer, dest),
// and every Write the size its push announced; runScript checks that on
// each ready line.
func runScript(t *testing.T, cfg Config, script string) *Manager {
	t.Helper()
	m := New(cfg)
	now := base
	sizes := map[string]uint64{}
	grants := map[string][]ids.ResID{} // "T/D" → every reservation id granted
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
		checkErr := func(err error) {
			switch want {
			case "":
				require.NoError(t, err, where)
			case "collision":
				require.ErrorIs(t, err, ErrCollision, where)
			case "invalid":
				require.ErrorIs(t, err, ErrInvalid, where)
			case "sizemismatch":
				require.ErrorIs(t, err, ErrSizeMismatch, where)
			default:
				t.Fatalf("%s: unknown expectation", where)
			}
		}
		switch f[0] {
		case "at":
			d, err := time.ParseDuration(f[1])
			require.NoError(t, err, where)
			now = base.Add(d)
		case "add":
			nb, err := strconv.ParseUint(f[3], 10, 64)
			require.NoError(t, err, where)
			var dests []string
			if len(f) > 4 {
				dests = strings.Split(f[4], ",")
			}
			err = m.Add(Push{TransferID: f[1], MMHash: f[2], NBytes: nb, Dests: dests}, now)
			checkErr(err)
			if err == nil {
				sizes[f[1]] = nb
			}
		case "grant":
			g := Grant{Kind: f[3]}
			switch {
			case g.Kind == "err":
				g = Grant{Err: strings.Join(f[4:], " ")}
			case len(f) > 4:
				res, err := strconv.ParseUint(f[4], 10, 64)
				require.NoError(t, err, where)
				g.Res, g.Token = ids.ResID(res), tokenFor(ids.ResID(res))
				g.NBytes = sizes[f[1]]
				if len(f) > 5 {
					g.NBytes, err = strconv.ParseUint(f[5], 10, 64)
					require.NoError(t, err, where)
				}
				key := f[1] + "/" + f[2]
				grants[key] = append(grants[key], g.Res)
			}
			m.Granted(f[1], f[2], g, now)
		case "source":
			src, err := strconv.ParseUint(f[2], 10, 64)
			require.NoError(t, err, where)
			nb, err := strconv.ParseUint(f[3], 10, 64)
			require.NoError(t, err, where)
			checkErr(m.SourceReady(f[1], SourceID(src), nb, now))
		case "wrote":
			m.WriteDone(f[1], f[2], errOf(f[3:]), now)
		case "completed":
			m.CompleteDone(f[1], f[2], errOf(f[3:]), now)
		case "cancel":
			m.Cancel(f[1], now)
		case "tick":
			m.Tick(now)
		case "ready":
			needWant()
			rd := m.Ready(now)
			require.Equal(t, want == "-", rd.Empty(), where)
			require.Equal(t, want, formatReady(rd), where)
			checkReady(t, where, rd, sizes, grants)
		case "state":
			needWant()
			got := "none"
			if st, ok := m.Status(f[1]); ok {
				var parts []string
				for d, s := range st {
					parts = append(parts, d+"="+s.String())
				}
				sort.Strings(parts)
				got = strings.Join(parts, " ")
			}
			require.Equal(t, want, got, where)
		case "pending":
			needWant()
			require.Equal(t, want, map[bool]string{true: "yes", false: "no"}[m.Pending()], where)
		case "next":
			needWant()
			got := "none"
			if at, ok := m.NextDeadline(); ok {
				got = at.Sub(base).String()
			}
			require.Equal(t, want, got, where)
		case "stats":
			needWant()
			got := statsMap(m.Stats())
			for _, kv := range strings.Fields(want) {
				k, v, _ := strings.Cut(kv, "=")
				gv, ok := got[k]
				require.True(t, ok, "%s: unknown stat %s", where, k)
				require.Equal(t, v, gv, "%s: stat %s", where, k)
			}
		default:
			t.Fatalf("%s: unknown command", where)
		}
		require.NoError(t, m.CheckInvariants(), where)
	}
	return m
}

func errOf(words []string) error {
	if len(words) == 0 {
		return nil
	}
	return errors.New(strings.Join(words, " "))
}

// formatReady renders Ready in a fixed order, destinations sorted, items in
// the order Ready gave them:
//
//	reserve D:T,T D:T | write D:T@SRC | complete D:T | cancel D:T | release SRC | fail T/D=REASON; ... | done T
func formatReady(rd Ready) string {
	var sections []string
	perDest := func(name string, m map[string][]string) {
		if len(m) == 0 {
			return
		}
		dests := make([]string, 0, len(m))
		for d := range m {
			dests = append(dests, d)
		}
		sort.Strings(dests)
		parts := []string{name}
		for _, d := range dests {
			parts = append(parts, d+":"+strings.Join(m[d], ","))
		}
		sections = append(sections, strings.Join(parts, " "))
	}
	perDest("reserve", collect(rd.Reserves, func(x ReserveItem) string { return x.TransferID }))
	perDest("write", collect(rd.Writes, func(x Write) string { return fmt.Sprintf("%s@s%d", x.TransferID, x.Src) }))
	perDest("complete", collect(rd.Completes, func(x Complete) string { return x.TransferID }))
	perDest("cancel", collect(rd.Cancels, func(x Cancel) string { return x.TransferID }))
	if len(rd.Releases) > 0 {
		var parts []string
		for _, s := range rd.Releases {
			parts = append(parts, fmt.Sprintf("s%d", s))
		}
		sections = append(sections, "release "+strings.Join(parts, ","))
	}
	if len(rd.Failures) > 0 {
		var parts []string
		for _, f := range rd.Failures {
			parts = append(parts, f.TransferID+"/"+f.Dest+"="+f.Reason)
		}
		sections = append(sections, "fail "+strings.Join(parts, "; "))
	}
	if len(rd.Done) > 0 {
		sections = append(sections, "done "+strings.Join(rd.Done, ","))
	}
	if len(sections) == 0 {
		return "-"
	}
	return strings.Join(sections, " | ")
}

func collect[T any](m map[string][]T, name func(T) string) map[string][]string {
	out := make(map[string][]string, len(m))
	for d, xs := range m {
		for _, x := range xs {
			out[d] = append(out[d], name(x))
		}
	}
	return out
}

// checkReady verifies what formatReady does not show: credentials and
// sizes, and that no destination has an empty batch.
func checkReady(t *testing.T, where string, rd Ready, sizes map[string]uint64, grants map[string][]ids.ResID) {
	granted := func(tid, dest string, res ids.ResID, tok ids.Token) {
		require.Contains(t, grants[tid+"/"+dest], res, "%s: %s to %s names a reservation never granted", where, tid, dest)
		require.True(t, tok.Equal(tokenFor(res)), "%s: %s to %s: token does not match reservation %d", where, tid, dest, res)
	}
	for _, xs := range rd.Reserves {
		require.NotEmpty(t, xs, where)
		for _, x := range xs {
			require.Equal(t, sizes[x.TransferID], x.NBytes, where)
		}
	}
	for d, xs := range rd.Writes {
		require.NotEmpty(t, xs, where)
		for _, x := range xs {
			granted(x.TransferID, d, x.Res, x.Token)
			require.Equal(t, sizes[x.TransferID], x.NBytes, where)
		}
	}
	for d, xs := range rd.Completes {
		require.NotEmpty(t, xs, where)
		for _, x := range xs {
			granted(x.TransferID, d, x.Res, x.Token)
		}
	}
	for d, xs := range rd.Cancels {
		require.NotEmpty(t, xs, where)
		for _, x := range xs {
			granted(x.TransferID, d, x.Res, x.Token)
		}
	}
}

func statsMap(s Stats) map[string]string {
	m := map[string]string{
		"transfers":  strconv.Itoa(s.Transfers),
		"sources":    strconv.Itoa(s.Sources),
		"inflight":   strconv.Itoa(s.InFlight),
		"ignored":    strconv.FormatUint(s.Ignored, 10),
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
	m["records"] = strings.Join(live, ",")
	m["ended"] = strings.Join(ended, ",")
	return m
}
