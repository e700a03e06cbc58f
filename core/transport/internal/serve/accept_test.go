package serve

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// scriptedListener hands out what its script says, then reports the
// listener closed.
type scriptedListener struct {
	steps []func() (net.Conn, error)
}

func (l *scriptedListener) accept() (net.Conn, error) {
	if len(l.steps) == 0 {
		return nil, net.ErrClosed
	}
	s := l.steps[0]
	l.steps = l.steps[1:]
	return s()
}

func TestAcceptorRetriesFailuresWithGrowingWaits(t *testing.T) {
	fail := func() (net.Conn, error) { return nil, errors.New("too many open files") }
	l := &scriptedListener{steps: []func() (net.Conn, error){fail, fail, fail}}
	var waits []time.Duration
	Acceptor[net.Conn]{
		Accept: l.accept,
		Admit:  func(net.Conn) bool { t.Fatal("nothing to admit"); return false },
		Failed: func(_ error, in time.Duration) { waits = append(waits, in) },
		Log:    slog.New(slog.DiscardHandler),
	}.Run()
	require.Equal(t, []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond}, waits)
}

func TestAcceptorPanicCostsOneConnection(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	c, d := net.Pipe()
	defer d.Close()
	l := &scriptedListener{steps: []func() (net.Conn, error){
		func() (net.Conn, error) { return a, nil },
		func() (net.Conn, error) { return c, nil },
	}}
	var admitted []net.Conn
	Acceptor[net.Conn]{
		Accept: l.accept,
		Tune: func(x net.Conn) {
			if x == a {
				panic("tuning failed")
			}
		},
		Admit: func(x net.Conn) bool { admitted = append(admitted, x); return true },
		Log:   slog.New(slog.DiscardHandler),
	}.Run()
	require.Equal(t, []net.Conn{c}, admitted, "the loop goes on after a panic")
	_, err := b.Write([]byte{1})
	require.ErrorIs(t, err, io.ErrClosedPipe, "the connection lost to the panic is closed")
}

func TestAcceptorEndsWhenAdmitSaysClosing(t *testing.T) {
	x, y := net.Pipe()
	defer y.Close()
	defer x.Close()
	l := &scriptedListener{steps: []func() (net.Conn, error){
		func() (net.Conn, error) { return x, nil },
		func() (net.Conn, error) { t.Fatal("accepted after closing"); return nil, nil },
	}}
	Acceptor[net.Conn]{Accept: l.accept, Admit: func(net.Conn) bool { return false }, Log: slog.New(slog.DiscardHandler)}.Run()
}

func TestConnsCapsAndCloses(t *testing.T) {
	s := NewConns[net.Conn](1)
	a, b := net.Pipe()
	defer b.Close()
	served := make(chan struct{})
	require.True(t, s.Admit(a, func(c net.Conn) {
		close(served)
		var p [1]byte
		_, _ = c.Read(p[:]) // until Close cuts it
	}, func(net.Conn) { t.Fatal("refused below the cap") }))
	<-served

	c, d := net.Pipe()
	defer d.Close()
	refused := false
	require.True(t, s.Admit(c, func(net.Conn) { t.Fatal("served past the cap") }, func(x net.Conn) { refused = true; _ = x.Close() }))
	require.True(t, refused)

	s.Close()
	s.Close()
	s.Wait()
	e, f := net.Pipe()
	defer f.Close()
	require.False(t, s.Admit(e, func(net.Conn) { t.Fatal("served after Close") }, nil), "closing")
	_, err := f.Write([]byte{1})
	require.Error(t, err, "a connection offered after Close is closed")
	select {
	case <-s.Done():
	default:
		t.Fatal("Done is closed by Close")
	}
}
