package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/proxy"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: proxyrss CONFIG_JSON")
		os.Exit(2)
	}
	cfg, err := proxy.DecodeConfig([]byte(os.Args[1]))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	p, err := proxy.Open(cfg, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer p.Close()
	fmt.Println("addr", p.Addr())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if strings.TrimSpace(in.Text()) != "rss" {
			fmt.Println("error: want rss")
			continue
		}
		rss, hwm, err := memory()
		if err != nil {
			fmt.Println("error:", err)
			continue
		}
		fmt.Println("rss", rss, hwm)
	}
}

// memory reads VmRSS and VmHWM, in kB.
func memory() (rss, hwm int64, err error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, 0, err
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		var v int64
		if _, err := fmt.Sscanf(string(line), "VmRSS: %d kB", &v); err == nil {
			rss = v
		}
		if _, err := fmt.Sscanf(string(line), "VmHWM: %d kB", &v); err == nil {
			hwm = v
		}
	}
	if rss == 0 || hwm == 0 {
		return 0, 0, fmt.Errorf("no VmRSS or VmHWM in /proc/self/status")
	}
	return rss, hwm, nil
}
