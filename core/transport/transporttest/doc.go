// Package transporttest holds fakes for testing data planes: Regions, a
// reservation table over a host or device slab that checks what every
// transport owes its sink; and the quiet logger and reproducible bytes
// that such tests share.
package transporttest
