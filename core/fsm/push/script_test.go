package push

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
	"github.com/stretchr/testify/require"
)

// base is the script clock's zero; "at 5s" sets the clock to base+5s.
var base = fsmtest.Base

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

// scriptErrs names the sentinels a script line may expect.
var scriptErrs = map[string]error{"collision": ErrCollision, "invalid": ErrInvalid, "sizemismatch": ErrSizeMismatch}

// runScript drives a Manager from a script (fsmtest.Script: at, next and
// stats lines, "-> want" expectations). CheckInvariants runs after every
// line. Its own commands:
//
//	add T H N D1,D2 [-> collision|invalid]
//	grant T D write RES [NBYTES]      token derived from RES; NBYTES defaults to the push's
//	grant T D follow|cached [RES]
//	grant T D err REASON...
//	grant T D KIND                    any other kind
//	source H SRC N [-> sizemismatch|invalid]
//	wrote T D [ERR...]
//	completed T D [ERR...]
//	cancel T
//	cancelled T D                     the shard answered the Cancel of (T, D), or the call failed
//	tick
//	ready -> SECTION | SECTION ...    or "-" when empty; see formatReady
//	state T -> D=STATE ...|none
//	pending -> yes|no
//
// Every Write, Complete and Cancel that Ready returns must carry the
// reservation id and token of the grant given for its (transfer, dest),
// and every Write the size its push announced; runScript checks that on
// each ready line.
func runScript(t *testing.T, cfg Config, script string) *Manager {
	t.Helper()
	m := New(cfg)
	sizes := map[string]uint64{}
	grants := map[string][]ids.ResID{} // "T/D" → every reservation id granted
	s := &fsmtest.Script{
		Next:  m.NextDeadline,
		Stats: func() map[string]string { return statsMap(m.Stats()) },
		Check: m.CheckInvariants,
	}
	s.Do = func(l fsmtest.Line) bool {
		a := l.Args
		switch l.Cmd {
		case "add":
			nb := l.Uint(2)
			var dests []string
			if len(a) > 3 {
				dests = strings.Split(a[3], ",")
			}
			err := m.Add(Push{TransferID: a[0], MMHash: a[1], NBytes: nb, Dests: dests}, s.Now)
			l.ExpectErr(err, scriptErrs)
			if err == nil {
				sizes[a[0]] = nb
			}
		case "grant":
			g := Grant{Kind: a[2]}
			switch {
			case g.Kind == "err":
				g = Grant{Err: l.Rest(3)}
			case len(a) > 3:
				res := ids.ResID(l.Uint(3))
				g.Res, g.Token = res, tokenFor(res)
				g.NBytes = sizes[a[0]]
				if len(a) > 4 {
					g.NBytes = l.Uint(4)
				}
				key := a[0] + "/" + a[1]
				grants[key] = append(grants[key], g.Res)
			}
			m.Granted(a[0], a[1], g, s.Now)
		case "source":
			l.ExpectErr(m.SourceReady(a[0], SourceID(l.Uint(1)), l.Uint(2), s.Now), scriptErrs)
		case "wrote":
			m.WriteDone(a[0], a[1], errOf(a[2:]), s.Now)
		case "landed":
			m.WriteDoneInBand(a[0], a[1], errOf(a[2:]), s.Now)
		case "completed":
			m.CompleteDone(a[0], a[1], errOf(a[2:]), s.Now)
		case "cancel":
			m.Cancel(a[0], s.Now)
		case "cancelled":
			m.CancelDone(a[0], a[1], s.Now)
		case "tick":
			m.Tick(s.Now)
		case "ready":
			l.NeedWant()
			rd := m.Ready(s.Now)
			require.Equal(t, l.Want == "-", rd.Empty(), l.Where)
			l.Expect(formatReady(rd))
			checkReady(t, l.Where, rd, sizes, grants)
		case "state":
			got := "none"
			if st, ok := m.Status(a[0]); ok {
				var parts []string
				for d, s := range st {
					parts = append(parts, d+"="+s.String())
				}
				sort.Strings(parts)
				got = strings.Join(parts, " ")
			}
			l.Expect(got)
		case "pending":
			l.Expect(fsmtest.YesNo(m.Pending()))
		default:
			return false
		}
		return true
	}
	s.Run(t, script)
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
func formatReady(rd Effects) string {
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
func checkReady(t *testing.T, where string, rd Effects, sizes map[string]uint64, grants map[string][]ids.ResID) {
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
		"cancelsout": strconv.Itoa(s.CancelsOut),
		"unanswered": strconv.Itoa(s.Unanswered),
		"collisions": strconv.FormatUint(s.Collisions, 10),
		"tombs":      strconv.Itoa(s.Tombstones),

		"completesout":    strconv.Itoa(s.CompletesOut),
		"completesfailed": strconv.FormatUint(s.CompletesFailed, 10),
		"windowwaits":     strconv.FormatUint(s.WindowWaits, 10),
		"extended":        strconv.FormatUint(s.WaitsExtended, 10),
	}
	m["records"] = strings.Join(fsmtest.Counts(s.Records), ",")
	m["ended"] = strings.Join(fsmtest.Counts(s.Ended), ",")
	return m
}
