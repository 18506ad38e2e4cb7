package userfile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
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

// ---- one output directory ----

// Dir is an output directory being written: files go to a temporary
// directory beside the destination (Path) and Commit renames it into place.
type Dir struct {
	g     *Guard
	final string
	tmp   string
	names []string // files written through Create / WriteFile
	done  bool
	// inPlace: Path is the destination itself (CreateDirInPlace); created:
	// the destination did not exist before.
	inPlace, created bool
}

// CreateDir starts writing the output directory out. out must pass Check,
// and if it exists it must be a directory that is empty or that this
// package made (its Marker lists exactly what it holds); anything else is
// refused, so that no file of the user's in it is ever replaced. Parent
// directories are created as needed. Call Commit when every file is
// written, or Abort (safe after Commit) to drop the temporary directory.
func (g *Guard) CreateDir(out string) (*Dir, error) {
	if err := g.Check(out); err != nil {
		return nil, err
	}
	if _, err := replaceable(out); err != nil {
		return nil, err
	}
	parent := filepath.Dir(filepath.Clean(out))
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return nil, Describe(parent, err)
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(filepath.Clean(out))+".tmp-*")
	if err != nil {
		return nil, Describe(out, err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		os.RemoveAll(tmp)
		return nil, Describe(out, err)
	}
	return &Dir{g: g, final: filepath.Clean(out), tmp: tmp}, nil
}

// CheckDir checks, without creating anything, that CreateDir(out) would be
// accepted (for a command to refuse its output before its work).
func (g *Guard) CheckDir(out string) error {
	if err := g.Check(out); err != nil {
		return err
	}
	_, err := replaceable(out)
	return err
}

// replaceable checks that out does not exist, is an empty directory, or is
// a directory made by this package holding exactly what its marker lists.
// It returns the marker's names (nil when out does not exist or is empty).
func replaceable(out string) ([]string, error) { return replaceableAt(out, 0) }

func replaceableAt(out string, depth int) ([]string, error) {
	lfi, err := os.Lstat(out)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, Describe(out, err)
	}
	if !lfi.IsDir() {
		return nil, refuse(out, "it exists and is %s, not a directory this command made", TypeName(lfi.Mode()))
	}
	ents, err := os.ReadDir(out)
	if err != nil {
		return nil, Describe(out, err)
	}
	if len(ents) == 0 {
		return nil, nil
	}
	b, err := ReadFile(filepath.Join(out, Marker), 1<<20)
	if err != nil {
		return nil, refuse(out, "the directory is not empty and was not made by sparsemla (no readable %s in it); give a new or empty directory", Marker)
	}
	var names []string
	for _, n := range strings.Split(string(b), "\n") {
		if n != "" {
			names = append(names, n)
		}
	}
	var have []string
	for _, e := range ents {
		if e.Name() != Marker {
			have = append(have, e.Name())
		}
	}
	want := slices.Clone(names)
	slices.Sort(want)
	slices.Sort(have)
	if !slices.Equal(want, have) {
		return nil, refuse(out, "the directory holds files sparsemla did not write (its %s lists %d, it holds %d); give a new or empty directory", Marker, len(want), len(have))
	}
	for _, e := range ents {
		if e.Name() == Marker || e.Type().IsRegular() {
			continue
		}
		// A directory this package made (demo --keep holds two dumps).
		if e.IsDir() && depth < 4 {
			if _, err := replaceableAt(filepath.Join(out, e.Name()), depth+1); err == nil {
				continue
			}
		}
		return nil, refuse(out, "it holds %s, which sparsemla did not write", Escape(e.Name()))
	}
	return names, nil
}

// CreateDirInPlace prepares the output directory out for outputs that are
// written into it one by one, each replacing only itself (each through its
// own temporary and rename, e.g. two dumps written by their own CreateDir):
// out must pass Check and be missing, empty or made by this package; it is
// created if missing. Path is then out itself; Commit writes the marker
// listing what was written; Abort removes what was written and out if it
// was created here. Used where the outputs' paths are printed as they are
// written (demo --keep).
func (g *Guard) CreateDirInPlace(out string) (*Dir, error) {
	if err := g.Check(out); err != nil {
		return nil, err
	}
	if _, err := replaceable(out); err != nil {
		return nil, err
	}
	created := false
	if _, err := os.Lstat(out); errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(out, 0o755); err != nil {
			return nil, Describe(out, err)
		}
		created = true
	}
	return &Dir{g: g, final: filepath.Clean(out), tmp: filepath.Clean(out), inPlace: true, created: created}, nil
}

// Path is the temporary directory the files go to until Commit.
func (d *Dir) Path() string { return d.tmp }

// Final is the destination directory.
func (d *Dir) Final() string { return d.final }

// checkName refuses names that are not one plain file name.
func checkName(name string) error {
	if name == "" || name == "." || name == ".." || name == Marker || strings.ContainsAny(name, `/\`) || Escape(name) != name {
		return fmt.Errorf("userfile: bad output file name %q", name)
	}
	return nil
}

// WriteFile writes one file of the directory through write (buffered; a
// full disk fails it, see FailWritesAfter).
func (d *Dir) WriteFile(name string, perm fs.FileMode, write func(w io.Writer) error) error {
	if d.done {
		return fmt.Errorf("userfile: %s: directory already committed", Escape(d.final))
	}
	if err := checkName(name); err != nil {
		return err
	}
	p := filepath.Join(d.tmp, name)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return Describe(filepath.Join(d.final, name), err)
	}
	d.names = append(d.names, name)
	bw := bufio.NewWriterSize(&budgetWriter{f, filepath.Join(d.final, name)}, 1<<20)
	werr := write(bw)
	if werr == nil {
		werr = bw.Flush()
	}
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return Describe(filepath.Join(d.final, name), werr)
	}
	return nil
}

// Adopt records a file that the caller wrote into Path() itself (by name),
// so that the marker lists it.
func (d *Dir) Adopt(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	fi, err := os.Lstat(filepath.Join(d.tmp, name))
	if err != nil {
		return Describe(filepath.Join(d.final, name), err)
	}
	if !fi.Mode().IsRegular() && !(fi.IsDir() && d.isOwnDir(name)) {
		return fmt.Errorf("userfile: %s is %s", Escape(filepath.Join(d.final, name)), TypeName(fi.Mode()))
	}
	if !slices.Contains(d.names, name) {
		d.names = append(d.names, name)
	}
	return nil
}

// isOwnDir reports whether the entry name of the directory is a directory
// this package made.
func (d *Dir) isOwnDir(name string) bool {
	_, err := replaceableAt(filepath.Join(d.tmp, name), 1)
	return err == nil
}

// Commit writes the marker, then moves the directory into place: over a
// missing or empty destination by one rename, over an earlier output of
// this package by renaming it aside first (and back if the second rename
// fails). Files in Path() that were neither written nor adopted are adopted.
func (d *Dir) Commit() error {
	if d.done {
		return nil
	}
	ents, err := os.ReadDir(d.tmp)
	if err != nil {
		return Describe(d.final, err)
	}
	for _, e := range ents {
		if e.Name() != Marker {
			if err := d.Adopt(e.Name()); err != nil {
				return err
			}
		}
	}
	slices.Sort(d.names)
	if d.inPlace {
		// Everything in out was written here or is an earlier output of
		// this package (checked by CreateDirInPlace): list it all.
		if err := d.writeMarker(); err != nil {
			return err
		}
		d.done = true
		return nil
	}
	if err := d.writeMarker(); err != nil {
		return err
	}
	if err := d.g.Check(d.final); err != nil {
		return err
	}
	old, err := replaceable(d.final)
	if err != nil {
		return err
	}
	if old == nil {
		// Missing or empty (os.Rename does not replace a directory, so an
		// empty one is removed first and made again if the rename fails).
		removed := os.Remove(d.final) == nil
		if err := os.Rename(d.tmp, d.final); err != nil {
			if removed {
				os.Mkdir(d.final, 0o755)
			}
			return Describe(d.final, err)
		}
		d.done = true
		return nil
	}
	aside, err := os.MkdirTemp(filepath.Dir(d.final), "."+filepath.Base(d.final)+".old-*")
	if err != nil {
		return Describe(d.final, err)
	}
	if err := os.Rename(d.final, filepath.Join(aside, "dir")); err != nil {
		os.Remove(aside)
		return Describe(d.final, err)
	}
	if err := os.Rename(d.tmp, d.final); err != nil {
		if rerr := os.Rename(filepath.Join(aside, "dir"), d.final); rerr == nil {
			os.Remove(aside)
		}
		return Describe(d.final, err)
	}
	d.done = true
	// The old directory held only files this package wrote (checked above).
	if err := os.RemoveAll(aside); err != nil {
		return Describe(aside, err)
	}
	return nil
}

func (d *Dir) writeMarker() error {
	p := filepath.Join(d.tmp, Marker)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return Describe(filepath.Join(d.final, Marker), err)
	}
	w := &budgetWriter{f, filepath.Join(d.final, Marker)}
	_, werr := io.WriteString(w, strings.Join(d.names, "\n")+"\n")
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return Describe(filepath.Join(d.final, Marker), werr)
	}
	return nil
}

// Abort removes the temporary directory (nothing of the destination is
// touched). Safe to call after Commit, and more than once.
func (d *Dir) Abort() {
	if d.done {
		return
	}
	d.done = true
	if d.inPlace {
		for _, n := range d.names {
			os.RemoveAll(filepath.Join(d.tmp, n))
		}
		if d.created {
			os.Remove(d.tmp)
		}
		return
	}
	os.RemoveAll(d.tmp)
}
