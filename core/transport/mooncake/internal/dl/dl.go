package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

// dlerror's text lives in a buffer the next dl call overwrites, so it is
// copied inside the same C call that failed.
static void *dl_open(const char *path, char **err) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) { const char *e = dlerror(); *err = strdup(e ? e : "dlopen failed"); }
	return h;
}
static int dl_open_global(const char *path, char **err) {
	if (dlopen(path, RTLD_NOW | RTLD_GLOBAL)) return 0;
	const char *e = dlerror(); *err = strdup(e ? e : "dlopen failed");
	return -1;
}
static void *dl_sym(void *h, const char *name, char **err) {
	dlerror();
	void *f = dlsym(h, name);
	if (!f) { const char *e = dlerror(); *err = strdup(e ? e : "symbol is NULL"); }
	return f;
}
*/
import "C"

import (
	"errors"
	"unsafe"
)

// Lib is a loaded library. It is never closed: the libraries loaded here
// run threads of their own, and unloading code under them is not worth the
// memory it would return.
type Lib struct{ h unsafe.Pointer }

// Open loads the library at path with RTLD_NOW | RTLD_LOCAL; the error is
// dlerror's text.
func Open(path string) (Lib, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	h := C.dl_open(cpath, &cerr)
	if h == nil {
		return Lib{}, takeErr(cerr)
	}
	return Lib{h: h}, nil
}

// OpenGlobal loads the library at path with RTLD_NOW | RTLD_GLOBAL, so
// that libraries loaded after it resolve their symbols against it; it is
// never closed.
func OpenGlobal(path string) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	if C.dl_open_global(cpath, &cerr) != 0 {
		return takeErr(cerr)
	}
	return nil
}

// Sym is the address of the function name; the error is dlerror's text.
func (l Lib) Sym(name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var cerr *C.char
	f := C.dl_sym(l.h, cname, &cerr)
	if f == nil {
		return nil, takeErr(cerr)
	}
	return f, nil
}

func takeErr(cerr *C.char) error {
	defer C.free(unsafe.Pointer(cerr))
	return errors.New(C.GoString(cerr))
}
