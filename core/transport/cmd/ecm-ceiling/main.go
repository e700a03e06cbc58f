package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport/shm"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "recv" && args[0] != "send" && args[0] != "copy") {
		fmt.Fprintln(stderr, "usage: ecm-ceiling recv|send|copy [flags] (-h for the flags)")
		return 2
	}
	role := args[0]
	fs := flag.NewFlagSet("ecm-ceiling "+role, flag.ContinueOnError)
	fs.SetOutput(stderr)
	procs := fs.Int("gomaxprocs", 0, "GOMAXPROCS of this process (0: the Go default)")
	chunk := fs.Int("chunk-bytes", tcp.DefaultChunkSize, "largest frame payload, the transfer's tcp_chunk_bytes")
	sockBuf := fs.Int("socket-buffer", 0, "SO_SNDBUF and SO_RCVBUF of every connection (0: the kernel's autotuning, as the transfer)")
	listen := fs.String("listen", "127.0.0.1:0", "recv: address to listen on")
	regions := fs.Int("regions", 4, "recv: receive regions touched before the first frame (one per connection served at once)")
	to := fs.String("to", "", "send: receivers, comma-separated host:port")
	schedule := fs.String("schedule", "4", "send: connections to each receiver, one round per entry, comma-separated")
	nbytes := fs.Int64("bytes", 1<<30, "send: bytes per round, over all receivers")
	rounds := fs.Int("rounds", 1, "send: rounds per -schedule entry; the fastest is reported")
	timeout := fs.Float64("timeout", 300, "send: seconds allowed per round")
	itemBytes := fs.Int("item-bytes", 4<<20, "copy: bytes per item")
	count := fs.Int("count", 1, "copy: items per round")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if *procs < 0 || *chunk < 64<<10 || *chunk > tcp.MaxFrame || *sockBuf < 0 || *regions < 0 || *rounds < 1 || *timeout <= 0 {
		fmt.Fprintln(stderr, "ecm-ceiling: want -gomaxprocs >= 0, -chunk-bytes in [64 KiB, 1 GiB], -socket-buffer >= 0, -regions >= 0, -rounds >= 1, -timeout > 0")
		return 2
	}
	if *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	params := map[string]any{
		"gomaxprocs":    runtime.GOMAXPROCS(0),
		"chunk_bytes":   *chunk,
		"socket_buffer": *sockBuf,
	}
	enc := json.NewEncoder(stdout)
	if role == "copy" {
		return copyCeiling(*itemBytes, *count, *rounds, params, enc, stderr)
	}
	if role == "recv" {
		return recv(*listen, tcp.TCPConfig{Conns: max(*regions, 1), ChunkSize: *chunk, SocketBuffer: *sockBuf}, params, stdin, enc, stderr)
	}
	addrs := strings.Split(*to, ",")
	if *to == "" {
		fmt.Fprintln(stderr, "ecm-ceiling send: -to is required")
		return 2
	}
	var entries []int
	for _, s := range strings.Split(*schedule, ",") {
		k, err := strconv.Atoi(s)
		if err != nil || k < 1 || k > 64 {
			fmt.Fprintf(stderr, "ecm-ceiling send: -schedule entry %q: want 1 to 64 connections\n", s)
			return 2
		}
		entries = append(entries, k)
	}
	if *nbytes < int64(len(addrs)) {
		fmt.Fprintln(stderr, "ecm-ceiling send: -bytes below one per receiver")
		return 2
	}
	best := make([]float64, 0, len(entries))
	all := make([][]float64, 0, len(entries))
	var sent int64
	for _, k := range entries {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*timeout*float64(*rounds)*float64(time.Second)))
		cfg := tcp.TCPConfig{Conns: k, ChunkSize: *chunk, SocketBuffer: *sockBuf}
		bps, n, err := tcp.CeilingSend(ctx, addrs, cfg, *nbytes, *rounds)
		cancel()
		if err != nil {
			fmt.Fprintf(stderr, "ecm-ceiling send: %d connections per receiver: %v\n", k, err)
			return 1
		}
		best = append(best, slices.Max(bps))
		all = append(all, bps)
		sent += n
	}
	params["schedule"] = entries
	params["receivers"] = len(addrs)
	params["bytes_per_round"] = *nbytes
	params["rounds"] = *rounds
	out := map[string]any{"bytes_per_sec": best, "rounds_bytes_per_sec": all, "bytes_sent": sent, "params": params}
	if err := enc.Encode(out); err != nil {
		return 1
	}
	return 0
}

func recv(addr string, cfg tcp.TCPConfig, params map[string]any, stdin io.Reader, enc *json.Encoder, stderr io.Writer) int {
	r, err := tcp.ListenCeiling(addr, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "ecm-ceiling recv: %v\n", err)
		return 1
	}
	params["regions"] = cfg.Conns
	if err := enc.Encode(map[string]any{"addr": r.Addr(), "params": params}); err != nil {
		_ = r.Close()
		return 1
	}
	// Serves until the process that started it closes our input.
	_, _ = io.Copy(io.Discard, stdin)
	_ = r.Close()
	st := r.Stats()
	if err := enc.Encode(map[string]any{"frames": st.Frames, "bytes": st.Bytes, "rejected": st.Rejected, "params": params}); err != nil {
		return 1
	}
	return 0
}

func copyCeiling(itemBytes, count, rounds int, params map[string]any, enc *json.Encoder, stderr io.Writer) int {
	rates, err := shm.CopyCeiling(itemBytes, count, rounds)
	if err != nil {
		fmt.Fprintf(stderr, "ecm-ceiling copy: %v\n", err)
		return 2
	}
	params["item_bytes"], params["count"], params["rounds"] = itemBytes, count, rounds
	if err := enc.Encode(map[string]any{"bytes_per_sec": slices.Max(rates), "rounds_bytes_per_sec": rates, "params": params}); err != nil {
		return 1
	}
	return 0
}
