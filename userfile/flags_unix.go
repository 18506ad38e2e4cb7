//go:build unix

package userfile

import "syscall"

// openFlags are added to every open for reading: non-blocking, so that
// opening a FIFO never waits for a writer (a regular file ignores it).
const openFlags = syscall.O_NONBLOCK
