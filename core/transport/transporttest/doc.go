// Package transporttest holds fakes for testing data planes: Regions, a
// reservation table over a host or device slab that checks what every
// transport owes its sink; Expiring, a context whose deadline passes when
// the test says rather than when a timer does; and the quiet logger and
// reproducible bytes that such tests share.
package transporttest
