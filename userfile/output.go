package userfile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
)

// Marker is the file an output directory made by this package holds: the
// names of the files written into it, one a line. An existing non-empty
// directory is replaced only when it holds exactly the files its marker
// lists (so nothing a user put there is ever removed).
const Marker = ".sparsemla-output"

// maxInputFiles bounds the files of input directories a Guard records for
// hard-link checks (an output inside an input directory is refused by
// ancestry whatever its size).
const maxInputFiles = 100000

// ErrOutput is wrapped by every refusal of a Guard.
var ErrOutput = errors.New("refused output path")

// Guard holds the inputs of one command and refuses outputs that would
// harm them.
type Guard struct {
	inputs []input
	files  []input // regular files inside input directories
}

type input struct {
	path string
	fi   fs.FileInfo
}

// NewGuard records the inputs of a command (files or directories; those
// that do not exist are skipped: nothing to harm).
func NewGuard(inputs ...string) (*Guard, error) {
	g := &Guard{}
	for _, p := range inputs {
		if err := g.Add(p); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// Add records one more input. A directory's regular files (any depth, up to
// maxInputFiles) are recorded too, so that an output hard-linked to one of
// them is refused.
func (g *Guard) Add(path string) error {
	if path == "" {
		return nil
	}
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return Describe(path, err)
	}
	g.inputs = append(g.inputs, input{path, fi})
	if !fi.IsDir() {
		return nil
	}
	n := 0
	return filepath.WalkDir(path, func(p string, de fs.DirEntry, err error) error {
		if err != nil || n >= maxInputFiles {
			return filepath.SkipDir
		}
		if de.IsDir() {
			return nil
		}
		// Follow symbolic links to files (cp -as leaves them), not to directories.
		fi, err := os.Stat(p)
		if err != nil || !fi.Mode().IsRegular() {
			return nil
		}
		g.files = append(g.files, input{p, fi})
		n++
		return nil
	})
}

func refuse(path, format string, a ...any) error {
	return &Error{Path: path, Reason: "refused as an output: " + fmt.Sprintf(format, a...), Err: ErrOutput}
}

// Check refuses out when it is one of the inputs, links to one (symbolic or
// hard link: same device and inode), lies inside an input directory
// (comparing every ancestor directory by device and inode, after resolving
// symbolic links, so bind mounts and links to directories are caught too),
// or is a directory that holds an input.
func (g *Guard) Check(out string) error {
	if out == "" {
		return refuse(out, "empty path")
	}
	if lfi, err := os.Lstat(out); err == nil {
		if lfi.Mode()&fs.ModeSymlink != 0 {
			if fi, err := os.Stat(out); err == nil {
				if in, ok := g.same(fi); ok {
					return refuse(out, "it is a symbolic link to the input %s", Escape(in))
				}
			}
		} else if in, ok := g.same(lfi); ok {
			if in == out {
				return refuse(out, "it is an input of this command")
			}
			return refuse(out, "it is the same file as the input %s (a hard link)", Escape(in))
		}
		if fi, err := os.Stat(out); err == nil && fi.IsDir() {
			for _, in := range g.inputs {
				if insideDir(in.path, fi) {
					return refuse(out, "the directory holds the input %s", Escape(in.path))
				}
			}
			// A directory of links to the inputs' files (cp -as, cp -al):
			// replacing it is harmless with a rename, but it is someone's
			// view of the input, not an output.
			if name, in, ok := g.holdsLink(out, 0); ok {
				return refuse(out, "it holds %s, a link to the input %s", Escape(name), Escape(in))
			}
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return Describe(out, err)
	}
	// Ancestors: lexically (a symbolic link on the way is stat'ed through)
	// and after resolving the longest existing prefix.
	if in, ok := g.insideInput(out); ok {
		return refuse(out, "it lies inside the input directory %s", Escape(in))
	}
	return nil
}

// holdsLink reports an entry of dir (or of its sub-directories, a few
// levels down) that is the same file as an input.
func (g *Guard) holdsLink(dir string, depth int) (name, in string, ok bool) {
	ents, err := os.ReadDir(dir)
	if err != nil || len(g.inputs)+len(g.files) == 0 {
		return "", "", false
	}
	for i, e := range ents {
		if i >= 10000 {
			break
		}
		p := filepath.Join(dir, e.Name())
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if in, ok := g.same(fi); ok {
			return p, in, true
		}
		if fi.IsDir() && depth < 3 {
			if n, in, ok := g.holdsLink(p, depth+1); ok {
				return n, in, true
			}
		}
	}
	return "", "", false
}

// same reports the input fi is, if any.
func (g *Guard) same(fi fs.FileInfo) (string, bool) {
	for _, l := range [][]input{g.inputs, g.files} {
		for _, in := range l {
			if os.SameFile(in.fi, fi) {
				return in.path, true
			}
		}
	}
	return "", false
}

// insideInput reports the input directory one of out's ancestors is.
func (g *Guard) insideInput(out string) (string, bool) {
	var dirs []input
	for _, in := range g.inputs {
		if in.fi.IsDir() {
			dirs = append(dirs, in)
		}
	}
	if len(dirs) == 0 {
		return "", false
	}
	check := func(p string) (string, bool) {
		fi, err := os.Stat(p)
		if err != nil {
			return "", false
		}
		for _, d := range dirs {
			if os.SameFile(d.fi, fi) {
				return d.path, true
			}
		}
		return "", false
	}
	abs, err := filepath.Abs(out)
	if err != nil {
		return "", false
	}
	for _, chain := range []string{abs, resolvedPrefix(abs)} {
		for p := filepath.Dir(chain); ; p = filepath.Dir(p) {
			if in, ok := check(p); ok {
				return in, true
			}
			if p == filepath.Dir(p) {
				break
			}
		}
	}
	return "", false
}

// resolvedPrefix resolves the symbolic links of the longest existing prefix
// of abs and appends the rest.
func resolvedPrefix(abs string) string {
	rest := ""
	for p := abs; ; p = filepath.Dir(p) {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Join(r, rest)
		}
		if p == filepath.Dir(p) {
			return abs
		}
		rest = filepath.Join(filepath.Base(p), rest)
	}
}

// insideDir reports whether path (an input) lies inside the directory dir
// (or is it), comparing ancestors by device and inode.
func insideDir(path string, dir fs.FileInfo) bool {
	abs, err := filepath.Abs(path)
	if err != nil {
		return false
	}
	for _, chain := range []string{abs, resolvedPrefix(abs)} {
		for p := chain; ; p = filepath.Dir(p) {
			if fi, err := os.Stat(p); err == nil && os.SameFile(fi, dir) {
				return true
			}
			if p == filepath.Dir(p) {
				break
			}
		}
	}
	return false
}

// ---- fault injection: a full disk on demand ----

var writeBudget atomic.Int64 // bytes left before ENOSPC; < 0: unlimited

func init() { writeBudget.Store(-1) }

// FailWritesAfter makes every writer of this package fail with ENOSPC once n
// more bytes (all writers together) are written, as a full disk would; for
// tests of what an error leaves behind. It returns a function that restores
// unlimited writes. Not for concurrent tests.
func FailWritesAfter(n int64) (restore func()) {
	writeBudget.Store(n)
	return func() { writeBudget.Store(-1) }
}

// budgetWriter writes to f, failing like a full disk when the budget is out.
type budgetWriter struct {
	f    *os.File
	name string
}

func (w *budgetWriter) Write(p []byte) (int, error) {
	for {
		left := writeBudget.Load()
		if left < 0 {
			return w.f.Write(p)
		}
		n := int64(len(p))
		if n > left {
			n = left
		}
		if !writeBudget.CompareAndSwap(left, left-n) {
			continue
		}
		m, err := w.f.Write(p[:n])
		if err == nil && int64(len(p)) > n {
			err = &fs.PathError{Op: "write", Path: w.name, Err: syscall.ENOSPC}
		}
		return m, err
	}
}

// ---- one output file ----

// ErrExists is wrapped by the refusal of an output file that exists and is
// not one sparsemla wrote (OutputFile).
var ErrExists = errors.New("output file exists")

// maxOwnHead bounds the bytes of an existing output file that OutputFile.Own
// is shown.
const maxOwnHead = 64 << 10

// OutputFile is the rule for one output file of a command, the same for
// every command: a path that does not exist is written (its directory must
// exist); one that exists is replaced only when it is a regular file that
// sparsemla wrote, as Own recognises from its first bytes (an HTML page it
// wrote, a native dump whose header names it as producer), or when Force is
// set (the user's --force). A directory, a FIFO or device, an input of the
// command or a link to one is never replaced, not even with Force.
type OutputFile struct {
	// Own reports whether head, the first bytes (at most 64 KiB) of the
	// existing file, is an output of sparsemla. Nil: no output of this kind
	// can be recognised (a KV-event stream carries no mark of its writer).
	Own func(head []byte) bool
	// What names the outputs Own recognises, for the refusal ("an HTML page
	// sparsemla wrote").
	What string
	// Force replaces any regular file that is not an input.
	Force bool
}

// CheckOutputFile checks, before a command's work, that out may be written
// under rule o (OutputFile) and the Guard's inputs (Check). Its refusals
// name out and say what to do.
func (g *Guard) CheckOutputFile(out string, o OutputFile) error {
	if out == "" {
		return refuse(out, "empty path")
	}
	fi, err := os.Stat(out)
	switch {
	case err == nil && fi.IsDir():
		return refuse(out, "it is a directory; give the path of a file")
	case err == nil && !fi.Mode().IsRegular():
		return refuse(out, "it is %s, not a regular file", TypeName(fi.Mode()))
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return Describe(out, err)
	}
	if err := g.Check(out); err != nil {
		return err
	}
	if err != nil { // does not exist: its directory must
		dir := filepath.Dir(out)
		dfi, derr := os.Stat(dir)
		switch {
		case errors.Is(derr, fs.ErrNotExist):
			return &Error{Path: out, Reason: "cannot be written: the directory " + Escape(dir) + " does not exist", Err: derr}
		case derr != nil:
			return Describe(dir, derr)
		case !dfi.IsDir():
			return &Error{Path: out, Reason: "cannot be written: " + Escape(dir) + " is " + TypeName(dfi.Mode()) + ", not a directory", Err: ErrNotRegular}
		}
		return nil
	}
	if o.Force || o.Own != nil && o.Own(fileHead(out)) {
		return nil
	}
	what := "a file sparsemla can tell it wrote"
	if o.What != "" {
		what = o.What
	}
	return &Error{Path: out, Reason: "refused as an output: it exists and is not " + what +
		"; remove it, give another path, or give --force to replace it", Err: errors.Join(ErrOutput, ErrExists)}
}

// fileHead returns the first bytes (at most maxOwnHead) of the regular file
// path; nil when it cannot be read.
func fileHead(path string) []byte {
	f, _, err := Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, maxOwnHead))
	return b
}

// WriteOutputFile writes out through write under rule o: CheckOutputFile,
// then WriteFile. The rule is checked again just before the rename.
func (g *Guard) WriteOutputFile(out string, perm fs.FileMode, o OutputFile, write func(w io.Writer) error) error {
	if err := g.CheckOutputFile(out, o); err != nil {
		return err
	}
	return g.writeFile(out, perm, func() error { return g.CheckOutputFile(out, o) }, write)
}

// WriteFile writes the file out through write: it checks out (Check),
// writes a temporary file in out's directory, syncs it, checks out again and
// renames the temporary file over out. On any error the temporary file is
// removed and out is left as it was. The file gets mode perm. It replaces
// any regular file that is not an input: commands write their outputs with
// WriteOutputFile, which replaces only their own.
func (g *Guard) WriteFile(out string, perm fs.FileMode, write func(w io.Writer) error) error {
	return g.writeFile(out, perm, func() error { return g.Check(out) }, write)
}

func (g *Guard) writeFile(out string, perm fs.FileMode, check func() error, write func(w io.Writer) error) error {
	if err := check(); err != nil {
		return err
	}
	if fi, err := os.Stat(out); err == nil && !fi.Mode().IsRegular() {
		return refuse(out, "it is %s", TypeName(fi.Mode()))
	}
	dir, base := filepath.Split(out)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return describeAs(out, err) // the temporary's name means nothing to the user
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	bw := bufio.NewWriterSize(&budgetWriter{f, out}, 1<<20)
	if err := write(bw); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return Describe(out, err)
	}
	if err := f.Chmod(perm); err != nil {
		return Describe(out, err)
	}
	if err := f.Sync(); err != nil {
		return Describe(out, err)
	}
	if err := f.Close(); err != nil {
		return Describe(out, err)
	}
	if err := check(); err != nil {
		return err
	}
	if err := os.Rename(tmp, out); err != nil {
		return describeAs(out, err)
	}
	ok = true
	return nil
}
