package hugemem

import (
	"os"
	"strconv"
	"strings"
	"syscall"
)

// madvCollapse is Linux's MADV_COLLAPSE (6.1 and later; not in package
// syscall): collapse the range's pages into huge pages now.
const madvCollapse = 25

// advise asks for huge pages on c (PageSize-aligned, whole pages): future
// faults get them (MADV_HUGEPAGE), and pages already present — memory the Go
// runtime reused and zeroed — are collapsed at once (MADV_COLLAPSE). Both are
// hints; their errors (an older kernel, THP off, a sandbox without them)
// leave ordinary pages.
func advise(c []byte) {
	_ = syscall.Madvise(c, syscall.MADV_HUGEPAGE)
	_ = syscall.Madvise(c, madvCollapse)
}

// ProcessHugeBytes is the process's anonymous memory on transparent huge
// pages (AnonHugePages of /proc/self/smaps_rollup), or -1 when it cannot be
// read: the benchmarks report it, to show whether the kernel granted them.
func ProcessHugeBytes() int64 {
	b, err := os.ReadFile("/proc/self/smaps_rollup")
	if err != nil {
		return -1
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "AnonHugePages:"); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
					return kb << 10
				}
			}
			return -1
		}
	}
	return -1
}
