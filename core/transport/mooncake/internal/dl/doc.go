// Package dl loads shared libraries at run time (dlopen) and finds their
// functions (dlsym), for the mooncake transport and its test double, which
// both reach a C library that the build does not link.
package dl
