package tcp

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// laterSink's frames end later (transport.LaterFrame), each the way the
// test chose for its reservation: landed, refused, or a panic.
type laterSink struct {
	mu       sync.Mutex
	outcomes map[ids.ResID]string
	// settled counts the frames settled; flushedAfter is, for each Flush,
	// how many had been settled then.
	settled      int
	flushedAfter []int
}

func (s *laterSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) {
	return nil, errors.New("laterSink takes frames only through BeginFrame")
}
func (s *laterSink) EndWrite(ids.ResID, bool) {}
func (s *laterSink) Flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushedAfter = append(s.flushedAfter, s.settled)
}
func (s *laterSink) BeginFrame(res ids.ResID, _ ids.Token, _, n uint64) (transport.Frame, error) {
	return &laterFrame{s: s, res: res, buf: make([]byte, n)}, nil
}

type laterFrame struct {
	s   *laterSink
	res ids.ResID
	buf []byte
}

func (f *laterFrame) Bytes() []byte     { return f.buf }
func (f *laterFrame) End(ok bool) error { return nil }
func (f *laterFrame) EndLater(bool) transport.Settle {
	return func() error {
		f.s.mu.Lock()
		f.s.settled++
		outcome := f.s.outcomes[f.res]
		f.s.mu.Unlock()
		switch {
		case outcome == "refuse":
			return fmt.Errorf("injected refusal: %w", transport.ErrGone)
		case outcome == "panic":
			panic("injected panic settling a frame")
		}
		return nil
	}
}

// TestFramesEndedLaterAreAckedAfterTheFlushWithTheirOutcome: frames whose
// sink ends them later are settled, then the sink flushed, and only then
// answered, each with how its end went; a frame whose end panicked is not
// answered, and the connection ends after the others' answers.
func TestFramesEndedLaterAreAckedAfterTheFlushWithTheirOutcome(t *testing.T) {
	sink := &laterSink{outcomes: map[ids.ResID]string{2: "refuse", 3: "panic"}}
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	c := dialProven(t, r.Addr())
	var frames []byte
	for i := range 3 {
		frames = append(AppendHeader(frames, Header{Seq: uint64(i + 1), Res: ids.ResID(i + 1), Length: 100}), randBytes(uint64(i), 100)...)
	}
	_, err := c.Write(frames)
	require.NoError(t, err)

	a := readAck(t, c)
	require.Equal(t, uint64(1), a.Seq)
	require.Equal(t, transport.StatusOK, a.Status, a.Msg)
	a = readAck(t, c)
	require.Equal(t, uint64(2), a.Seq)
	require.Equal(t, transport.StatusOf(transport.ErrGone), a.Status)
	require.Contains(t, a.Msg, "injected refusal")
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = io.ReadFull(c, make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the frame whose end panicked is not answered, and the connection ends")
	sink.mu.Lock()
	require.NotEmpty(t, sink.flushedAfter)
	require.Equal(t, 3, sink.flushedAfter[len(sink.flushedAfter)-1], "a Flush came after the three frames were settled")
	sink.mu.Unlock()
	st := r.Stats()
	require.Equal(t, uint64(1), st.Frames, "only the frame that landed counts as landed")
	require.Equal(t, uint64(100), st.Bytes)
	require.Equal(t, uint64(1), st.Rejected[transport.StatusOf(transport.ErrGone).String()], "%v", st.Rejected)
}
