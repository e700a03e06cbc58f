package cudaipc

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The ready-word region: the memory through which a producer's GPU tells
// a shard that a write's bytes are in the slab. Laid out here, once, for
// both sides (as io_uring.h and Aeron's LogBufferDescriptor are):
//
//	slot i (0 <= i < wordSlots) is the 8 bytes at i*wordSize, a uint64
//	in host order, read and written only with atomic loads and stores.
//
//	a word's value is generation<<32 | sequence:
//	  generation  the attachment's, chosen by the shard in the hello
//	              reply (never 0), so that a word of another attachment
//	              or incarnation never matches;
//	  sequence    the producer's count of announced items on this
//	              attachment, from 1, strictly increasing, so that a value
//	              an earlier use left in a slot never equals a fresh one.
//	  0 is no value: a slot holding 0 is free.
//
// Invariants:
//   - One region per producer connection (attachment), created by the
//     shard as a memfd of wordsLen bytes sealed against shrinking and
//     growing, passed to that producer alone with SCM_RIGHTS in the hello
//     reply. A producer can only store into its own region, so it can
//     only ever complete its own announced items.
//   - The producer announces (reservation, token, slot, value) on its
//     connection before the copies are queued; its GPU stores the value
//     into the slot after the copies, on the same stream, with a memory
//     barrier (cuStreamWriteValue64, flags 0). So a slot holding the
//     announced value means the bytes are in the slab.
//   - The shard accepts an announcement only for a slot below wordSlots
//     that it is not watching, with this attachment's generation and a
//     sequence above every one it accepted before on it.
//   - The shard stores 0 into a slot after it saw the announced value
//     there, and before it marks the item ready; it does so too for an
//     entry it refused because its write was gone or not that token's
//     (the producer's word still lands), and never for one of another
//     generation or an old sequence. The producer reuses a slot only when
//     it holds 0 and no write of its own is pending on it. A slot whose
//     write failed is not reused on that attachment.
//   - The producer never announces slot probeSlot: when it registers the
//     region with a device it has that device store word(generation, 0)
//     there and reads it back, so a driver whose stream stores do not
//     reach the region is found before any item waits on one; it stores
//     0 there afterwards.
//   - The shard trusts nothing it reads: a value other than the one
//     announced leaves the item waiting; nothing but the announced value
//     completes it, and only while the shard still holds its write open.
const (
	wordSize  = 8
	wordSlots = 4096
	wordsLen  = wordSize * wordSlots // 32 KiB: whole pages

	// probeSlot is the producer's own: it stores a probe word there when
	// it registers the region with a device (writer.go, probe) and never
	// announces an item in it.
	probeSlot = wordSlots - 1

	// maxSequence is the last sequence an attachment announces; the
	// writer greets the shard again for a fresh region after it.
	maxSequence = 1<<32 - 1
)

// word is the value announced for the item of sequence seq on an
// attachment of generation gen.
func word(gen, seq uint32) uint64 { return uint64(gen)<<32 | uint64(seq) }

// splitWord is word's inverse.
func splitWord(v uint64) (gen, seq uint32) { return uint32(v >> 32), uint32(v) }

// words is a mapping of a ready-word region.
type words struct {
	mem []byte // wordsLen bytes, MAP_SHARED
}

func (w words) at(slot uint32) *uint64 {
	return (*uint64)(unsafe.Pointer(&w.mem[int(slot)*wordSize]))
}

// load reads slot; the caller checked slot < wordSlots.
func (w words) load(slot uint32) uint64 { return atomic.LoadUint64(w.at(slot)) }

// store writes v into slot: the shard's 0 that frees it, or a producer
// whose device cannot store words itself, after the copies completed.
func (w words) store(slot uint32, v uint64) { atomic.StoreUint64(w.at(slot), v) }

func (w words) unmap() error { return unix.Munmap(w.mem) }

// newWordsRegion creates a region for one attachment: the memfd (closed
// by the caller once handed over) and the shard's own mapping of it.
func newWordsRegion() (int, words, error) {
	fd, err := unix.MemfdCreate("ecmooncake-cudaipc-words", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, words{}, fmt.Errorf("memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, words, error) {
		unix.Close(fd)
		return -1, words{}, fmt.Errorf("ready-word region: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, wordsLen); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal", err)
	}
	w, err := mapWords(fd)
	if err != nil {
		return fail("mmap", err)
	}
	return fd, w, nil
}

// mapWords checks that fd is a ready-word region (a memfd of wordsLen
// bytes that can neither shrink nor grow, so that no page under the
// mapping can vanish) and maps it shared, read-write.
func mapWords(fd int) (words, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return words{}, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != wordsLen {
		return words{}, fmt.Errorf("not a %d-byte regular file (mode %#o, %d bytes)", wordsLen, st.Mode, st.Size)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return words{}, fmt.Errorf("not a memfd (F_GET_SEALS: %w)", err)
	}
	if want := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW; seals&want != want {
		return words{}, fmt.Errorf("the memfd is not sealed against resizing (seals %#x)", seals)
	}
	mem, err := unix.Mmap(fd, 0, wordsLen, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return words{}, err
	}
	return words{mem: mem}, nil
}
