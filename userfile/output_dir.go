package userfile

// Output directories: Dir, written into a temporary directory beside the
// destination and renamed into place by Commit, and the rule for which
// existing directory may be replaced (replaceable).

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
)

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
