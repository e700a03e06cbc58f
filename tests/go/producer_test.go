package gotests

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
)

// A consumer whose host name never resolves holds up only its own pushes:
// Submit, Sources and Poll for another consumer go on while its dial hangs.
func TestHangingDialDoesNotStallOtherConsumers(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	dial := func(zctx *zmq.Context, ep string, log *slog.Logger) (*control.Client, error) {
		if strings.Contains(ep, "hang.invalid") {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-release
			return nil, errors.New("resolver gave up")
		}
		return control.Dial(zctx, ep, log)
	}
	pcfg := config.DefaultProducer()
	pcfg.ControlTimeoutS = 5
	opts := c.nodeOpts(nil)
	opts.Dial = dial
	prod, err := node.OpenProducer(pcfg, opts)
	require.NoError(t, err)
	defer func() {
		close(release)
		require.NoError(t, prod.Close())
	}()

	errs := prod.Submit([]producer.Push{{TransferID: "tx-hang", MMHash: "mm-hang", NBytes: 10, Consumer: "tcp://hang.invalid:5555"}})
	require.NoError(t, errs[0])
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the lookup never dialled")
	}

	items := makeItems(30, 1, 4096, 4096, 0)
	c.expect("req-other", items)
	done := make(chan []string, 1)
	go func() {
		it := items[0]
		errs := prod.Submit([]producer.Push{{TransferID: it.tid, MMHash: it.hash, NBytes: uint64(len(it.data)), Consumer: c.consumer, Meta: metaOf(it)}})
		if errs[0] != nil {
			done <- []string{"submit: " + errs[0].Error()}
			return
		}
		if _, errs := prod.Sources([]producer.Source{{MMHash: it.hash, Mem: it.data}}); errs[0] != nil {
			done <- []string{"sources: " + errs[0].Error()}
			return
		}
		var got []string
		for len(got) == 0 {
			o := prod.Poll(100 * time.Millisecond)
			got = append(got, o.Done...)
			for _, f := range o.Failed {
				if f.TransferID == it.tid {
					got = append(got, "failed: "+f.Reason)
				}
			}
		}
		done <- got
	}()
	select {
	case got := <-done:
		require.Equal(t, []string{items[0].tid}, got)
	case <-time.After(60 * time.Second):
		t.Fatal("a push to a healthy consumer is stuck behind another consumer's dial")
	}
	c.verify(items)
}
