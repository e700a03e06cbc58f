package control

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
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
	ep := startHalf(b, "TestCrossProcessServer", "ECM_XPROC_SERVER", 1)["endpoint"]
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

// startHalf runs this test binary again as test, the child's half of a
// cross-process benchmark (which env=1 enables), reads the n "key value"
// lines it prints first, and ends it, by closing its stdin, when b ends.
func startHalf(b *testing.B, test, env string, n int) map[string]string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$")
	cmd.Env = append(os.Environ(), env+"=1")
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	b.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
	kv := map[string]string{}
	r := bufio.NewReader(stdout)
	for len(kv) < n {
		line, err := r.ReadString('\n')
		require.NoError(b, err)
		k, v, _ := strings.Cut(strings.TrimSpace(line), " ")
		kv[k] = v
	}
	return kv
}

// reportFloors takes one sample of each path in turn (one(i) measures
// path i), b.N rounds, back to back (gap=0) and with both processes idle
// before each sample (gap=1ms), and reports each path's p50 and p99 in
// microseconds and, beside the first path, the floor, their ratio to it.
func reportFloors(b *testing.B, paths []string, one func(i int) (time.Duration, error)) {
	for _, gap := range []time.Duration{0, time.Millisecond} {
		b.Run(fmt.Sprintf("gap=%v", gap), func(b *testing.B) {
			lat := make([][]time.Duration, len(paths))
			for range b.N {
				for i := range paths {
					if gap > 0 {
						time.Sleep(gap)
					}
					d, err := one(i)
					if err != nil {
						b.Fatal(paths[i], err)
					}
					lat[i] = append(lat[i], d)
				}
			}
			pct := func(i int, q float64) float64 {
				s := slices.Clone(lat[i])
				slices.Sort(s)
				return float64(s[min(len(s)-1, int(q*float64(len(s))))]) / 1e3
			}
			floor50, floor99 := pct(0, 0.50), pct(0, 0.99)
			for i, name := range paths {
				p50, p99 := pct(i, 0.50), pct(i, 0.99)
				b.ReportMetric(p50, name+"-p50-us")
				b.ReportMetric(p99, name+"-p99-us")
				if i > 0 {
					b.ReportMetric(p50/floor50, name+"-p50-x-"+paths[0])
					b.ReportMetric(p99/floor99, name+"-p99-x-"+paths[0])
				}
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
