//go:build !linux

package hugemem

// advise does nothing where transparent huge pages are not known.
func advise([]byte) {}

// ProcessHugeBytes is -1: not known on this system.
func ProcessHugeBytes() int64 { return -1 }
