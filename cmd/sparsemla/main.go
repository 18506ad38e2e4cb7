package main

import (
	"fmt"
	"io"
	"os"
	"sort"
)

// Exit codes shared by every command.
const (
	exitOK       = 0 // agree / success
	exitDiverged = 1 // a divergence was found
	exitError    = 2 // bad input, bad flags, I/O error
	// exitIncomplete: no divergence among what was compared, but something
	// the dump holds was not compared (verdict "incomplete").
	exitIncomplete = 3
)

// command is one entry of the subcommand table. Each command lives in its own
// file and adds itself with register from an init function.
type command struct {
	name    string
	summary string // one line for `sparsemla help`
	// run executes the command with its own arguments (after the name) and
	// returns the exit code. It writes results to stdout and diagnostics to stderr.
	run func(args []string, stdout, stderr io.Writer) int
}

var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("sparsemla: duplicate command " + c.name)
	}
	commands[c.name] = c
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches args to a subcommand; it is main without os.Exit, for tests.
// Help that is asked for ('help', 'help CMD', '--help') goes to stdout with
// exit status 0; a command line that is wrong (no command, an unknown one,
// 'help' of an unknown command) is an error on stderr, exit status 2.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitError
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
		switch {
		case len(args) == 1:
			usage(stdout)
			return exitOK
		case len(args) > 2:
			fmt.Fprintf(stderr, "sparsemla help: takes one command name, got %d (run 'sparsemla help')\n", len(args)-1)
			return exitError
		}
		c, ok := commands[args[1]]
		if !ok {
			fmt.Fprintf(stderr, "sparsemla help: unknown command %q (run 'sparsemla help')\n", args[1])
			return exitError
		}
		return c.run([]string{"--help"}, stdout, stderr)
	}
	c, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "sparsemla: unknown command %q (run 'sparsemla help')\n", args[0])
		return exitError
	}
	return c.run(args[1:], stdout, stderr)
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "sparsemla: a CPU reference for DeepSeek-V4 sparse latent attention")
	fmt.Fprintln(w, "\nUsage: sparsemla <command> [flags] [args]\n\nCommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nExit status: 0 agree, 1 diverged, 2 error, 3 incomplete (nothing diverged, but not everything\nthe input holds was compared or judged). 'sparsemla <command> --help' for flags.")
}
