//go:build unix

package dump

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"sparsemla/userfile"
)

// within fails the test if fn takes more than 5 s (a FIFO opened for
// reading blocks until a writer comes: forever).
func within(t *testing.T, what string, fn func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: blocked", what)
		return nil
	}
}

// TestOpenRefusesSpecialFiles: a FIFO or a device as the dump, as a file
// of a dump directory, as a name map or as the config a name map names is
// refused at once with a message saying what it is.
func TestOpenRefusesSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.smd")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	withFifo := filepath.Join(dir, "withfifo")
	os.Mkdir(withFifo, 0o755)
	os.WriteFile(filepath.Join(withFifo, "a.smd"), writeNative(t, keyed()), 0o644)
	os.Symlink(fifo, filepath.Join(withFifo, "b.smd"))
	devDump := filepath.Join(dir, "zero.safetensors")
	os.Symlink("/dev/zero", devDump)

	// An official-v4-tiny copy whose config.json is /dev/zero.
	tiny := filepath.Join("..", "testdata", "official-v4-tiny")
	zeroCfg := filepath.Join(dir, "tiny")
	os.Mkdir(zeroCfg, 0o755)
	ents, err := os.ReadDir(tiny)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		abs, _ := filepath.Abs(filepath.Join(tiny, e.Name()))
		target := abs
		if e.Name() == "config.json" {
			target = "/dev/zero"
		}
		os.Symlink(target, filepath.Join(zeroCfg, e.Name()))
	}
	for _, c := range []struct{ path, want string }{
		{fifo, "FIFO"},
		{withFifo, "FIFO"},
		{devDump, "character device"},
		{zeroCfg, "config.json: is a character device"},
	} {
		err := within(t, c.path, func() error {
			d, err := Open(c.path)
			if err == nil {
				d.Close()
			}
			return err
		})
		if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, userfile.ErrNotRegular) {
			t.Errorf("Open(%s) = %v, want an error with %q", c.path, err, c.want)
		}
	}
	err = within(t, "name map", func() error { _, err := LoadNameMap(fifo); return err })
	if err == nil || !strings.Contains(err.Error(), "FIFO") {
		t.Errorf("LoadNameMap(FIFO) = %v", err)
	}
	err = within(t, "name map", func() error { _, err := LoadNameMap("/dev/zero"); return err })
	if err == nil || !strings.Contains(err.Error(), "character device") {
		t.Errorf("LoadNameMap(/dev/zero) = %v", err)
	}
	err = within(t, "safetensors", func() error { _, err := OpenSafetensors(fifo); return err })
	if err == nil || !strings.Contains(err.Error(), "FIFO") {
		t.Errorf("OpenSafetensors(FIFO) = %v", err)
	}
}

// TestOpenErrorsSayWhatTheyAre: a symbolic-link loop and a missing file are
// reported as such (they used to become "unrecognised file"), and a name
// with control characters is printed escaped.
func TestOpenErrorsSayWhatTheyAre(t *testing.T) {
	dir := t.TempDir()
	d := filepath.Join(dir, "d")
	os.Mkdir(d, 0o755)
	os.WriteFile(filepath.Join(d, "a.smd"), writeNative(t, keyed()), 0o644)
	os.Symlink(filepath.Join(d, "loop2.smd"), filepath.Join(d, "loop1.smd"))
	os.Symlink(filepath.Join(d, "loop1.smd"), filepath.Join(d, "loop2.smd"))
	_, err := Open(d)
	if err == nil || !strings.Contains(err.Error(), "too many levels of symbolic links") {
		t.Errorf("loop: %v", err)
	}
	evil := filepath.Join(dir, "x\nsparsemla replay: agree\x1b[32m.smd")
	_, err = Open(evil)
	if err == nil || strings.ContainsAny(err.Error(), "\n\x1b") || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("evil name: %q", err)
	}
	if os.Geteuid() != 0 {
		p := filepath.Join(dir, "secret.smd")
		os.WriteFile(p, writeNative(t, keyed()), 0o000)
		if _, err := Open(p); err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("unreadable: %v", err)
		}
	}
}
