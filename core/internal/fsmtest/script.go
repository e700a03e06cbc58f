package fsmtest

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Base is the script clock's zero; "at 5s" sets the clock to Base+5s.
var Base = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// Script drives one state machine from a small line-oriented script, in
// the manner of Pebble's datadriven tests. Each line is a command,
// optionally followed by "-> want"; commands that return something must
// state what they expect. Blank lines and lines starting with # are
// skipped. The runner knows the commands every machine shares:
//
//	at D                set the clock to Base+D (a Go duration)
//	next -> D|none      NextDeadline as an offset from Base
//	stats -> key=value ...  only the keys given are compared
//
// and hands every other line to Do.
type Script struct {
	// Now is the script clock: Base until an "at" line moves it.
	Now time.Time
	// Do runs one machine-specific line and reports whether it knew the
	// command.
	Do func(l Line) bool
	// Next is the machine's NextDeadline, for "next" lines.
	Next func() (time.Time, bool)
	// Stats renders the machine's stats by key, for "stats" lines.
	Stats func() map[string]string
	// Check runs after every line: the machine's invariants.
	Check func() error
}

// Line is one command of a script.
type Line struct {
	T *testing.T
	// Where names the line in failure messages: "line N: text".
	Where string
	Cmd   string
	// Args are the fields after the command, before any "->".
	Args []string
	// Want is the text after "->", trimmed; HasWant says there was one.
	Want    string
	HasWant bool
}

// Run runs every line of script against s.
func (s *Script) Run(t *testing.T, script string) {
	t.Helper()
	if s.Now.IsZero() {
		s.Now = Base
	}
	for n, raw := range strings.Split(script, "\n") {
		text := strings.TrimSpace(raw)
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		cmd, want, hasWant := strings.Cut(text, "->")
		f := strings.Fields(cmd)
		l := Line{T: t, Where: fmt.Sprintf("line %d: %s", n+1, text), Cmd: f[0], Args: f[1:], Want: strings.TrimSpace(want), HasWant: hasWant}
		switch {
		case l.Cmd == "at":
			s.Now = Base.Add(l.Duration(0))
		case l.Cmd == "next" && s.Next != nil:
			got := "none"
			if at, ok := s.Next(); ok {
				got = at.Sub(Base).String()
			}
			l.Expect(got)
		case l.Cmd == "stats" && s.Stats != nil:
			l.NeedWant()
			got := s.Stats()
			for _, kv := range strings.Fields(l.Want) {
				k, v, _ := strings.Cut(kv, "=")
				gv, ok := got[k]
				require.True(t, ok, "%s: unknown stat %s", l.Where, k)
				require.Equal(t, v, gv, "%s: stat %s", l.Where, k)
			}
		case !s.Do(l):
			t.Fatalf("%s: unknown command", l.Where)
		}
		if s.Check != nil {
			require.NoError(t, s.Check(), l.Where)
		}
	}
}

// NeedWant fails the test unless the line states its expected result.
func (l Line) NeedWant() {
	l.T.Helper()
	require.True(l.T, l.HasWant, "%s: command must state its expected result", l.Where)
}

// Expect fails the test unless the line states got as its result.
func (l Line) Expect(got string) {
	l.T.Helper()
	l.NeedWant()
	require.Equal(l.T, l.Want, got, l.Where)
}

// ExpectErr checks err against the line's result: none wants no error, a
// name of errs wants an error that wraps that sentinel.
func (l Line) ExpectErr(err error, errs map[string]error) {
	l.T.Helper()
	if l.Want == "" {
		require.NoError(l.T, err, l.Where)
		return
	}
	want, ok := errs[l.Want]
	if !ok {
		l.T.Fatalf("%s: unknown expectation", l.Where)
	}
	require.ErrorIs(l.T, err, want, l.Where)
}

// Rest joins the arguments from i on (empty when there are none).
func (l Line) Rest(i int) string {
	if i >= len(l.Args) {
		return ""
	}
	return strings.Join(l.Args[i:], " ")
}

// Uint parses argument i.
func (l Line) Uint(i int) uint64 {
	l.T.Helper()
	v, err := strconv.ParseUint(l.Args[i], 10, 64)
	require.NoError(l.T, err, l.Where)
	return v
}

// Int parses argument i.
func (l Line) Int(i int) int {
	l.T.Helper()
	v, err := strconv.Atoi(l.Args[i])
	require.NoError(l.T, err, l.Where)
	return v
}

// Duration parses argument i as a Go duration.
func (l Line) Duration(i int) time.Duration {
	l.T.Helper()
	d, err := time.ParseDuration(l.Args[i])
	require.NoError(l.T, err, l.Where)
	return d
}

// YesNo renders a predicate for "-> yes|no" lines.
func YesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// OrDash joins list with commas, "-" when it is empty.
func OrDash(list []string) string {
	if len(list) == 0 {
		return "-"
	}
	return strings.Join(list, ",")
}

// Counts renders a count per state as sorted "State:n" items.
func Counts[K interface {
	comparable
	fmt.Stringer
}, V int | uint64](m map[K]V) []string {
	out := make([]string, 0, len(m))
	for k, n := range m {
		out = append(out, fmt.Sprintf("%s:%d", k, n))
	}
	slices.Sort(out)
	return out
}
