package shm

import (
	"context"
	"syscall"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// BenchmarkWrite32MiB is one 32 MiB item into a warm mapping: the copy
// and nothing else, to compare with a plain memcpy of the same size.
func BenchmarkWrite32MiB(b *testing.B) {
	const n = 32 << 20
	fd := memfd(b, slabBytes*64, true)
	mem := mapFD(b, fd, slabBytes*64, syscall.MAP_SHARED)
	r, err := New(Config{Host: "h1", SlabFD: fd}).Listen("127.0.0.1:0", memSink{mem: mem})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	items := []transport.WriteItem{{Src: pattern(n, 1), Addr: r.(transport.Direct).RemoteAddr(0), Size: n}}
	b.SetBytes(n)
	for b.Loop() {
		if err := w.Write(context.Background(), r.Addr(), items)[0]; err != nil {
			b.Fatal(err)
		}
	}
}
