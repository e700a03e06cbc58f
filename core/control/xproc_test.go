package control

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// TestCrossProcessServer is the server half of BenchmarkCrossProcess: run
// by the benchmark in a child process, it serves until its stdin closes.
func TestCrossProcessServer(t *testing.T) {
	if os.Getenv("ECM_XPROC_SERVER") == "" {
		t.Skip("the server half of BenchmarkCrossProcess")
	}
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	srv, err := NewServer(zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil)
	require.NoError(t, err)
	fmt.Println("endpoint", srv.Endpoint())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	srv.Close()
	zctx.Term()
}

// BenchmarkCrossProcess times one Call (a status of one id) to a server in
// another process, the path of every reserve_batch and complete_batch:
// back to back (gap=0), and with the caller idle between calls (a sleep of
// gap), as a producer is between the steps of a batch, so that the threads
// on both sides have gone to sleep when the call comes:
//
//	GOMAXPROCS=4 go test -run=NONE -bench=CrossProcess ./core/control
//
// us/call excludes the gap. The server is this test binary again, run as
// TestCrossProcessServer.
func BenchmarkCrossProcess(b *testing.B) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrossProcessServer$")
	cmd.Env = append(os.Environ(), "ECM_XPROC_SERVER=1")
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	defer func() { stdin.Close(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(b, err)
	ep := strings.TrimSpace(strings.TrimPrefix(line, "endpoint "))

	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer zctx.Term()
	cli, err := Dial(zctx, ep, nil)
	require.NoError(b, err)
	defer cli.Close()
	body := wire.Status{TransferIDs: []string{"transfer-0"}}
	var out wire.StatusReply
	require.NoError(b, cli.Call(context.Background(), wire.OpStatus, body, &out))
	for _, gap := range []time.Duration{0, 200 * time.Microsecond, time.Millisecond} {
		b.Run(fmt.Sprintf("gap=%v", gap), func(b *testing.B) {
			var total time.Duration
			for range b.N {
				if gap > 0 {
					time.Sleep(gap)
				}
				start := time.Now()
				if err := cli.Call(context.Background(), wire.OpStatus, body, &out); err != nil {
					b.Fatal(err)
				}
				total += time.Since(start)
			}
			b.ReportMetric(float64(total)/float64(b.N)/1e3, "us/call")
		})
	}
}
