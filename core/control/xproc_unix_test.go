package control

import (
	"bufio"
	"context"
	"fmt"
	"net"
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

// TestCrossProcessUnixServer is the server half of BenchmarkUnixFloors:
// run by the benchmark in a child process, it serves the same handler over
// ZeroMQ and over Unix, and the two floors beside them, a bare Unix echo
// and a bare REP socket, until its stdin closes.
func TestCrossProcessUnixServer(t *testing.T) {
	if os.Getenv("ECM_XPROC_UNIX") == "" {
		t.Skip("the server half of BenchmarkUnixFloors")
	}
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	srv, err := NewServer(zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil)
	require.NoError(t, err)
	us, err := ListenUnix(fmt.Sprintf("@ecmooncake/bench/%d/control", os.Getpid()), HandlerFunc(statusEcho), Security{}, nil)
	require.NoError(t, err)
	bare, err := net.ListenUnix("unix", &net.UnixAddr{Name: fmt.Sprintf("@ecmooncake/bench/%d/bare", os.Getpid()), Net: "unix"})
	require.NoError(t, err)
	go func() {
		for {
			c, err := bare.AcceptUnix()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				for {
					f, err := readUnixFrame(c)
					if err != nil {
						return
					}
					out, _ := appendUnixFrame(nil, f)
					if _, err := c.Write(out); err != nil {
						return
					}
				}
			}()
		}
	}()
	// The bare REP lives in a context of its own, which is never
	// terminated: the process ends with it.
	rctx, err := zmq.NewContext()
	require.NoError(t, err)
	rep, err := rctx.NewSocket(zmq.REP)
	require.NoError(t, err)
	require.NoError(t, rep.Bind("tcp://127.0.0.1:*"))
	repEP, err := rep.GetLastEndpoint()
	require.NoError(t, err)
	go func() {
		for {
			m, err := rep.RecvBytes(0)
			if err != nil {
				return
			}
			if _, err := rep.SendBytes(m, 0); err != nil {
				return
			}
		}
	}()
	fmt.Println("zmq", srv.Endpoint())
	fmt.Println("unix", us.Endpoint())
	fmt.Println("bare-unix", bare.Addr().String())
	fmt.Println("bare-zmq", repEP)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	_ = bare.Close()
	_ = us.Close()
	_ = srv.Close()
}

// BenchmarkUnixFloors times one status call to a server in another
// process over the Unix path (UnixClient) and over ZeroMQ (Client) beside
// the floors of the same process pair: a bare Unix-socket round trip of
// the same frame and a bare libzmq REQ/REP. The four are taken in turn,
// call by call, so that they share the machine's load; back to back
// (gap=0) and with every caller idle between calls (gap=1ms), when the
// threads on both sides have gone to sleep:
//
//	GOMAXPROCS=2 go test -run=NONE -bench=UnixFloors ./core/control
//
// Each figure is a p50 or p99 in microseconds (excluding the gap), and
// x-bare-unix the ratio of a path to the bare Unix round trip.
func BenchmarkUnixFloors(b *testing.B) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrossProcessUnixServer$")
	cmd.Env = append(os.Environ(), "ECM_XPROC_UNIX=1")
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	defer func() { stdin.Close(); _ = cmd.Wait() }()
	eps := map[string]string{}
	r := bufio.NewReader(stdout)
	for len(eps) < 4 {
		line, err := r.ReadString('\n')
		require.NoError(b, err)
		k, v, _ := strings.Cut(strings.TrimSpace(line), " ")
		eps[k] = v
	}

	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer zctx.Term()
	zc, err := Dial(zctx, eps["zmq"], nil)
	require.NoError(b, err)
	defer zc.Close()
	uc, err := DialUnix(eps["unix"], Security{}, nil)
	require.NoError(b, err)
	defer uc.Close()
	bare, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: eps["bare-unix"], Net: "unix"})
	require.NoError(b, err)
	defer bare.Close()
	req, err := zctx.NewSocket(zmq.REQ)
	require.NoError(b, err)
	require.NoError(b, req.SetLinger(0))
	require.NoError(b, req.Connect(eps["bare-zmq"]))
	defer req.Close()

	body := wire.Status{TransferIDs: []string{"transfer-0"}}
	frame := mustEncode(b, 1, wire.OpStatus, body)
	framed, err := appendUnixFrame(nil, frame)
	require.NoError(b, err)
	var out wire.StatusReply
	paths := []struct {
		name string
		call func() error
	}{
		{"bare-unix", func() error {
			if _, err := bare.Write(framed); err != nil {
				return err
			}
			_, err := readUnixFrame(bare)
			return err
		}},
		{"bare-zmq", func() error {
			if _, err := req.SendBytes(frame, 0); err != nil {
				return err
			}
			_, err := req.RecvBytes(0)
			return err
		}},
		{"unix", func() error { return uc.Call(context.Background(), wire.OpStatus, body, &out) }},
		{"zmq", func() error { return zc.Call(context.Background(), wire.OpStatus, body, &out) }},
	}
	for _, p := range paths {
		require.NoError(b, p.call(), p.name) // connect and warm up
	}
	for _, gap := range []time.Duration{0, time.Millisecond} {
		b.Run(fmt.Sprintf("gap=%v", gap), func(b *testing.B) {
			lat := make([][]time.Duration, len(paths))
			for range b.N {
				for i, p := range paths {
					if gap > 0 {
						time.Sleep(gap)
					}
					start := time.Now()
					if err := p.call(); err != nil {
						b.Fatal(p.name, err)
					}
					lat[i] = append(lat[i], time.Since(start))
				}
			}
			pct := func(i int, q float64) float64 {
				s := slices.Clone(lat[i])
				slices.Sort(s)
				return float64(s[min(len(s)-1, int(q*float64(len(s))))]) / 1e3
			}
			floor50, floor99 := pct(0, 0.50), pct(0, 0.99)
			for i, p := range paths {
				p50, p99 := pct(i, 0.50), pct(i, 0.99)
				b.ReportMetric(p50, p.name+"-p50-us")
				b.ReportMetric(p99, p.name+"-p99-us")
				if i > 0 {
					b.ReportMetric(p50/floor50, p.name+"-p50-x-bare-unix")
					b.ReportMetric(p99/floor99, p.name+"-p99-x-bare-unix")
				}
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
