package gotests

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
)

// hangingDial is ZeroMQ links whose dial of a host name under
// hang.invalid waits for release, as a resolver that never answers would.
type hangingDial struct {
	*control.ZMQ
	entered chan<- struct{}
	release <-chan struct{}
}

func (h hangingDial) Dial(ep string, log *slog.Logger) (control.Caller, error) {
	if strings.Contains(ep, "hang.invalid") {
		select {
		case h.entered <- struct{}{}:
		default:
		}
		<-h.release
		return nil, errors.New("resolver gave up")
	}
	return h.ZMQ.Dial(ep, log)
}

// A consumer whose host name never resolves holds up only its own pushes:
// Submit, Sources and Poll for another consumer go on while its dial hangs.
func TestHangingDialDoesNotStallOtherConsumers(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1})
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	pcfg := config.DefaultProducer()
	pcfg.ControlTimeoutS = 5
	opts := c.nodeOpts(nil)
	opts.Control = func() control.Links {
		z, err := control.NewZMQ(control.Security{})
		require.NoError(t, err)
		return hangingDial{ZMQ: z, entered: entered, release: release}
	}
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
