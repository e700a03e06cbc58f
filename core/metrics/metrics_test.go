package metrics

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/valyala/fasthttp"
)

func scrape(t *testing.T) string {
	t.Helper()
	b, err := Text(nil)
	require.NoError(t, err)
	return string(b)
}

// runs keeps label values unique per run, so that -count=N sees fresh
// series (the registry is process-wide).
var runs int

func TestEventsAppearInText(t *testing.T) {
	runs++
	tr, op := fmt.Sprintf("unit-tcp-%d", runs), fmt.Sprintf("unit_op_%d", runs)
	Moved(tr, 3<<20)
	WriteBatch(tr, 2*time.Millisecond, nil)
	WriteBatch(tr, time.Millisecond, errors.New("reset"))
	Failed("unit", tr)
	Fallback("unit", tr)
	RoundTrip(op, time.Millisecond, nil)
	TransferWait(time.Millisecond)
	text := scrape(t)
	for _, want := range []string{
		fmt.Sprintf(`ecm_transfer_bytes_total{transport="%s"} 3.145728e+06`, tr),
		fmt.Sprintf(`ecm_transfer_items_total{transport="%s"} 1`, tr),
		fmt.Sprintf(`ecm_transfer_item_bytes_count{transport="%s"} 1`, tr),
		fmt.Sprintf(`ecm_transfer_write_seconds_count{outcome="error",transport="%s"} 1`, tr),
		fmt.Sprintf(`ecm_failures_total{component="unit",reason="%s"} 1`, tr),
		fmt.Sprintf(`ecm_fallbacks_total{component="unit",reason="%s"} 1`, tr),
		fmt.Sprintf(`ecm_control_round_trips_total{op="%s",outcome="ok"} 1`, op),
		`ecm_transfer_wait_seconds_count`,
		`go_goroutines`,
	} {
		require.Contains(t, text, want)
	}
}

func TestProbesReportUntilUnwatched(t *testing.T) {
	unwatch := Watch("consumer:unit", func(e *Emitter) {
		e.Set(Reservations, 2, "WRITING")
		e.Set(SlabBytesInUse, 4096)
	})
	twin := Watch("consumer:unit", func(e *Emitter) { e.Set(SlabBytesInUse, 1) })
	text := scrape(t)
	require.Contains(t, text, `ecm_reservations{object="consumer:unit",state="WRITING"} 2`)
	require.Contains(t, text, `ecm_slab_bytes_in_use{object="consumer:unit"} 4096`)
	require.Contains(t, text, `ecm_slab_bytes_in_use{object="consumer:unit#2"} 1`, "a second object of the same name is told apart")
	unwatch()
	unwatch()
	twin()
	require.NotContains(t, scrape(t), `object="consumer:unit`)
}

func TestBadProbeFailsOnlyItsSeries(t *testing.T) {
	cases := map[string]Probe{
		"unknown series":    func(e *Emitter) { e.Set("ecm_no_such_series", 1) },
		"wrong label count": func(e *Emitter) { e.Set(Reservations, 1) },
		"panicking probe":   func(e *Emitter) { panic("boom") },
	}
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			good := Watch("good", func(e *Emitter) { e.Set(SlabBytes, 7) })
			bad := Watch("bad", p)
			defer good()
			defer bad()
			b, err := Text(nil)
			require.Error(t, err)
			require.Contains(t, string(b), `ecm_slab_bytes{object="good"} 7`)
		})
	}
}

func TestServerServesMetricsAndHealth(t *testing.T) {
	srv, err := Serve("127.0.0.1", 0, nil, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, srv.Close()) }()
	_, _, err = net.SplitHostPort(srv.Addr())
	require.NoError(t, err)
	for path, want := range map[string]int{"/metrics": 200, "/health": 200, "/nope": 404} {
		code, body, err := fasthttp.GetTimeout(nil, fmt.Sprintf("http://%s%s", srv.Addr(), path), 5*time.Second)
		require.NoError(t, err)
		require.Equal(t, want, code, path)
		if path == "/metrics" {
			require.True(t, strings.Contains(string(body), "# TYPE go_goroutines gauge"))
		}
	}
}

func TestReasonFoldsTexts(t *testing.T) {
	for text, want := range map[string]string{
		"reserve: context deadline exceeded":                                           "timeout",
		"control: reserve_batch #3 to tcp://h:1: control: authentication failed: ...":  "auth",
		"the server requires an auth_secret (CURVE); set the deployment's auth_secret": "auth",
		"dial tcp 10.0.0.1:5: connection refused":                                      "unreachable",
		"cancelled by the scheduler":                                                   "cancelled",
		"slab full":                                                                    "no_space",
		"something else":                                                               "other",
	} {
		require.Equal(t, want, Reason(text), text)
	}
}

func TestPhasesAddUpAndAppearInText(t *testing.T) {
	runs++
	name := fmt.Sprintf("unit_phase_%d", runs)
	Phase(name, 100*time.Microsecond)
	Phase(name, 300*time.Microsecond)
	Phase(name, -time.Second)
	got := Phases()[name]
	require.Equal(t, uint64(2), got.Count, "a negative duration (clocks that disagree) is dropped")
	require.InDelta(t, 400e-6, got.Seconds, 1e-9)
	require.Contains(t, scrape(t), fmt.Sprintf(`ecm_ready_path_phase_seconds_count{phase="%s"} 2`, name))
}
