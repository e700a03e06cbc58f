package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// A receiver and a sender as python/ecmooncake/ceiling.py runs them: the
// receiver reports its address, the sender one rate per round, and the
// receiver, once its input closes, as many bytes as the sender sent.
func TestCeilingRecvSend(t *testing.T) {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	var stderr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run([]string{"recv", "-gomaxprocs", "2", "-chunk-bytes", "65536", "-regions", "2"}, inR, outW, &stderr)
		_ = outW.Close()
	}()
	lines := bufio.NewScanner(outR)
	require.True(t, lines.Scan(), "no address: %s", stderr.String())
	var hello struct {
		Addr   string         `json:"addr"`
		Params map[string]any `json:"params"`
	}
	require.NoError(t, json.Unmarshal(lines.Bytes(), &hello))
	require.NotEmpty(t, hello.Addr)
	require.EqualValues(t, 2, hello.Params["gomaxprocs"])

	var out bytes.Buffer
	rc := run([]string{"send", "-to", hello.Addr, "-schedule", "1,2", "-bytes", "1000000", "-rounds", "3",
		"-chunk-bytes", "65536", "-gomaxprocs", "2"}, nil, &out, &stderr)
	require.Zero(t, rc, stderr.String())
	var sent struct {
		Rates  []float64      `json:"bytes_per_sec"`
		Rounds [][]float64    `json:"rounds_bytes_per_sec"`
		Sent   int64          `json:"bytes_sent"`
		Params map[string]any `json:"params"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &sent))
	require.Len(t, sent.Rates, 2)
	require.Len(t, sent.Rounds, 2)
	for i, rounds := range sent.Rounds {
		require.Len(t, rounds, 3)
		require.Equal(t, slices.Max(rounds), sent.Rates[i], "the fastest round is the entry's figure")
	}
	require.EqualValues(t, 65536, sent.Params["chunk_bytes"])
	require.EqualValues(t, 3, sent.Params["rounds"])
	// Three rounds of 1,000,000 bytes per entry, and one chunk per
	// connection (1, then 2) to warm up.
	require.Equal(t, int64(2*3*1000000+3*65536), sent.Sent)

	require.NoError(t, inW.Close())
	require.True(t, lines.Scan(), "no count: %s", stderr.String())
	var count struct {
		Bytes uint64 `json:"bytes"`
	}
	require.NoError(t, json.Unmarshal(lines.Bytes(), &count))
	require.Equal(t, uint64(sent.Sent), count.Bytes)
	require.Zero(t, <-done, stderr.String())
}

func TestCeilingBadArguments(t *testing.T) {
	var out, stderr bytes.Buffer
	for _, args := range [][]string{
		nil,
		{"loop"},
		{"send"},
		{"send", "-to", "127.0.0.1:1", "-schedule", "0"},
		{"recv", "-chunk-bytes", "10"},
		{"send", "-to", "127.0.0.1:1", "-rounds", "0"},
		{"recv", "-nonsense"},
	} {
		require.Equal(t, 2, run(args, nil, &out, &stderr), "%q", args)
	}
}
