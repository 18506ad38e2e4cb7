// Package hugemem allocates the large, read-mostly buffers of the fast paths
// (packed weight panels) so that the operating system can back them with
// transparent huge pages.
//
// A decode step streams every packed weight once: 5.6 GB for the 43 layers of
// V4-Flash at 64K, 2-32 MiB per GEMV. On 4 KiB pages each call crosses a page
// (and takes a TLB miss, and restarts the hardware prefetcher's stream) every
// 4 KiB; on 2 MiB pages every 2 MiB. On the 2-core Zen 5 development VM the
// small FP8 GEMVs (wkv, 2 MiB; wq_a, 4 MiB) took 14-27 % less time a call on
// huge pages, the streaming read 7-8 % less (bench/README.md, round 9).
//
// Bytes carves buffers out of 2 MiB-aligned chunks that it advises for huge
// pages (madvise MADV_HUGEPAGE, then MADV_COLLAPSE for pages the Go runtime
// had already touched). The chunks are ordinary Go memory: the garbage
// collector frees a chunk once no buffer carved from it is referenced, so a
// buffer lives exactly as long as a make'd one would. Advice is only a hint:
// where the kernel has no transparent huge pages (or refuses, as a sandbox
// may), the buffers are ordinary pages and nothing else changes. Nothing here
// changes a value: the contents are zero, as make's are.
package hugemem
