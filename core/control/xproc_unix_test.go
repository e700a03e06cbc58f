package control

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
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
	eps := startHalf(b, "TestCrossProcessUnixServer", "ECM_XPROC_UNIX", 4)

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
	names := make([]string, len(paths))
	for i, p := range paths {
		names[i] = p.name
	}
	reportFloors(b, names, func(i int) (time.Duration, error) {
		start := time.Now()
		err := paths[i].call()
		return time.Since(start), err
	})
}
