package gotests

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// A real etcd (Debian's etcd-server) for the engine's etcd:// metadata,
// started once per test process on first use and stopped when the
// process's tests end (withMooncake). It listens on loopback only: the
// tests that use it run against the real engine, which
// build/test_mooncake_real.sh runs inside a network namespace of its own,
// so the server lives and dies inside that namespace. It runs without
// authentication, so nothing secret is ever on its command line.
//
// One server per process, not per test: Mooncake's etcd client is
// process-wide (libetcd_wrapper keeps one client, reference-counted
// across engines), so engines of one process talk to the endpoints the
// first of them named, whatever later ones pass.
var etcdServer struct {
	once sync.Once
	url  string // etcd://127.0.0.1:port
	err  error
	cmd  *exec.Cmd
	dir  string
	log  *os.File
	done chan struct{}
}

// etcdStartTimeout bounds how long etcd may take to answer its health
// check: a hang bound on a loaded 2-core machine, not a speed claim.
const etcdStartTimeout = 60 * time.Second

// realEtcd is the etcd:// metadata string of the process's etcd, started
// on first use.
func realEtcd() (string, error) {
	etcdServer.once.Do(func() { etcdServer.url, etcdServer.err = startEtcd() })
	return etcdServer.url, etcdServer.err
}

func startEtcd() (string, error) {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return "", fmt.Errorf("no etcd on PATH (bash build/setup.sh installs Debian's etcd-server): %w", err)
	}
	var last error
	// Ports are picked free and handed to etcd, which another process may
	// take in between: a few attempts, each with a fresh pair.
	for attempt := 0; attempt < 3; attempt++ {
		url, err := tryEtcd(bin)
		if err == nil {
			return url, nil
		}
		last = err
		stopEtcd()
	}
	return "", last
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func tryEtcd(bin string) (string, error) {
	client, err := freePort()
	if err != nil {
		return "", err
	}
	peer, err := freePort()
	if err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "ecm-etcd-")
	if err != nil {
		return "", err
	}
	etcdServer.dir = dir
	if etcdServer.log, err = os.Create(filepath.Join(dir, "etcd.log")); err != nil {
		return "", err
	}
	c := fmt.Sprintf("http://127.0.0.1:%d", client)
	p := fmt.Sprintf("http://127.0.0.1:%d", peer)
	cmd := exec.Command(bin,
		"--name", "ecm-test",
		"--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", c, "--advertise-client-urls", c,
		"--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
		"--initial-cluster", "ecm-test="+p,
		"--log-level", "warn")
	cmd.Stdout, cmd.Stderr = etcdServer.log, etcdServer.log
	// Its own process group, so that stopping it reaches nothing else,
	// and killed with this process if the tests die first.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start etcd: %w", err)
	}
	etcdServer.cmd = cmd
	etcdServer.done = make(chan struct{})
	go func() { _ = cmd.Wait(); close(etcdServer.done) }()

	ctx, cancel := context.WithTimeout(context.Background(), etcdStartTimeout)
	defer cancel()
	for {
		select {
		case <-etcdServer.done:
			return "", fmt.Errorf("etcd exited before it was healthy: %s", etcdLog())
		case <-ctx.Done():
			return "", fmt.Errorf("etcd on %s not healthy within %s: %s", c, etcdStartTimeout, etcdLog())
		case <-time.After(50 * time.Millisecond):
		}
		if etcdHealthy(ctx, c) {
			return fmt.Sprintf("etcd://127.0.0.1:%d", client), nil
		}
	}
}

func etcdHealthy(ctx context.Context, base string) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/health", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode == http.StatusOK && strings.Contains(string(body), `"health":"true"`)
}

func etcdLog() string {
	if etcdServer.dir == "" {
		return "(no log)"
	}
	b, err := os.ReadFile(filepath.Join(etcdServer.dir, "etcd.log"))
	if err != nil {
		return err.Error()
	}
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// stopEtcd stops the process's etcd, if one was started, and removes its
// data: SIGTERM, then SIGKILL if it has not exited within the bound.
func stopEtcd() {
	if etcdServer.cmd != nil && etcdServer.cmd.Process != nil {
		_ = syscall.Kill(-etcdServer.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-etcdServer.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-etcdServer.cmd.Process.Pid, syscall.SIGKILL)
			<-etcdServer.done
		}
	}
	if etcdServer.log != nil {
		_ = etcdServer.log.Close()
	}
	if etcdServer.dir != "" {
		_ = os.RemoveAll(etcdServer.dir)
	}
	etcdServer.cmd, etcdServer.log, etcdServer.dir = nil, nil, ""
}

// needEtcd is the etcd:// string for a test against the real engine; it
// skips against the double (which has no etcd client) and fails where the
// run must test the real engine but etcd cannot start.
func needEtcd(t *testing.T) string {
	t.Helper()
	if mcEngine == "" {
		t.Skip("etcd:// needs the real engine's etcd client; the double has none")
	}
	url, err := realEtcd()
	if err != nil {
		if os.Getenv(EnvRequireMooncake) == "1" {
			t.Fatalf("%s=1 and etcd is unavailable: %v", EnvRequireMooncake, err)
		}
		t.Skipf("the engine's etcd mode is NOT tested: %v", err)
	}
	return url
}

// etcdKeys lists the keys under prefix in the process's etcd, through
// its v3 JSON gateway (etcd 3.4 serves /v3/kv/range).
func etcdKeys(ctx context.Context, prefix string) ([]string, error) {
	if etcdServer.url == "" {
		return nil, errors.New("no etcd started")
	}
	base := "http://" + strings.TrimPrefix(etcdServer.url, "etcd://")
	end := []byte(prefix)
	end[len(end)-1]++
	b64 := base64.StdEncoding.EncodeToString
	body := fmt.Sprintf(`{"key":%q,"range_end":%q,"keys_only":true}`, b64([]byte(prefix)), b64(end))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v3/kv/range", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out struct {
		Kvs []struct {
			Key string `json:"key"`
		} `json:"kvs"`
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("etcd range %s: %s", prefix, resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&out); err != nil {
		return nil, fmt.Errorf("etcd range %s: %w", prefix, err)
	}
	keys := make([]string, 0, len(out.Kvs))
	for _, kv := range out.Kvs {
		k, err := base64.StdEncoding.DecodeString(kv.Key)
		if err != nil {
			return nil, fmt.Errorf("etcd range %s: key %q: %w", prefix, kv.Key, err)
		}
		keys = append(keys, string(k))
	}
	return keys, nil
}
