//go:build !unix

package userfile

// openFlags: no FIFOs to guard against outside unix.
const openFlags = 0
