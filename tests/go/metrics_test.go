package gotests

import (
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// sample reads one series' value from the process's metrics text, 0 when
// it is absent.
func sample(t *testing.T, text, series string) float64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(text)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	return v
}

// A push through producer, sharded consumer and scheduler shows up in the
// process's metrics: items and bytes written, each shard's slab and
// received bytes, the scheduler's transfer wait, control round trips; and
// a closed object stops reporting.
func TestRuntimeObjectsReportMetrics(t *testing.T) {
	scrape := func() string {
		b, err := metrics.Text(nil)
		require.NoError(t, err)
		return string(b)
	}
	before := scrape()
	c := newCluster(t, clusterOpts{tp: 2})
	items := makeItems(7, 4, 1<<20, 1<<20, 0)
	out := c.pushAll("req-m", items)
	require.Empty(t, out.Failed)
	w := c.wait(tids(items), 10*time.Second)
	require.Len(t, w.Available, len(items))

	text := scrape()
	tr := `{transport="tcp"}`
	require.Equal(t, float64(len(items)*2), sample(t, text, "ecm_transfer_items_total"+tr)-sample(t, before, "ecm_transfer_items_total"+tr), "one write per item per shard")
	require.Equal(t, float64(len(items)*2<<20), sample(t, text, "ecm_transfer_bytes_total"+tr)-sample(t, before, "ecm_transfer_bytes_total"+tr))
	require.Greater(t, sample(t, text, "ecm_transfer_wait_seconds_count"), sample(t, before, "ecm_transfer_wait_seconds_count"))
	require.Greater(t, sample(t, text, `ecm_control_round_trips_total{op="reserve_batch",outcome="ok"}`), 0.0)
	for _, sh := range c.shards {
		obj := fmt.Sprintf(`{object="consumer:%d"}`, sh.Info().TPRank+c.base)
		require.Equal(t, float64(sh.Stats().Size), sample(t, text, "ecm_slab_bytes"+obj))
		require.Equal(t, float64(len(items)<<20), sample(t, text, `ecm_received_bytes_total{object="consumer:`+strconv.Itoa(sh.Info().TPRank+c.base)+`",transport="tcp"}`))
	}
	require.Equal(t, float64(len(items)*2), sample(t, text, `ecm_pushes_ended_total{object="producer",state="Done"}`), "one push record per item per shard")
	for _, series := range []string{"ecm_completes_out", "ecm_completes_failed_total", "ecm_complete_window_waits_total", "ecm_source_waits_extended_total"} {
		// Present, and zero: every complete was answered, accepted, within its window.
		require.Regexp(t, `(?m)^`+series+`\{object="producer"\} 0$`, string(text))
	}

	c.close()
	require.NotContains(t, scrape(), fmt.Sprintf(`object="consumer:%d"`, c.base), "closed objects stop reporting")
}
