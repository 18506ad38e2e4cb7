// Command sparsemla replays DeepSeek-V4 sparse-attention dumps from a GPU decode
// path through an exact CPU reference and names the first divergence. It only
// parses flags, opens files through the library (dump, engine, replay, fault,
// prefixcheck, htmlreport, userfile) and prints; it imports none of the
// numeric packages (attention, indexer, kvcache, quant).
//
// Usage:
//
//	sparsemla <command> [flags] [args]
//
// Exit status: 0 = agree (or the command succeeded), 1 = diverged, 2 = error,
// 3 = incomplete (nothing diverged, but not everything the input holds was
// compared or judged: the report says what and why; prefix: requests it could
// not judge).
// Run `sparsemla help` for the list of commands and `sparsemla <command> --help`
// for the flags of one.
package main
