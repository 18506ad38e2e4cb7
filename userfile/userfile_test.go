//go:build unix

package userfile

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestEscape(t *testing.T) {
	cases := map[string]string{
		"plain/name_1.smd":           "plain/name_1.smd",
		"a\nsparsemla replay: agree": `a\nsparsemla replay: agree`,
		"\x1b[31mred\x1b[0m":         `\x1b[31mred\x1b[0m`,
		"tab\there\r":                `tab\there\r`,
		"bad\xffutf8":                `bad\xffutf8`,
		"rtl\u202egnp.exe":           `rtl\u202egnp.exe`,
		"c1\u0085x":                  `c1\u0085x`,
		"ünïcödé ok":                 "ünïcödé ok",
		`back\slash`:                 `back\slash`,
		"del\x7f":                    `del\x7f`,
	}
	for in, want := range cases {
		if got := Escape(in); got != want {
			t.Errorf("Escape(%q) = %q, want %q", in, got, want)
		}
	}
	if got := OneLine("a: x\nb: y\n\n"); got != "a: x; b: y" {
		t.Errorf("OneLine = %q", got)
	}
}

func TestOpenRefusesSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.smd")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	link := filepath.Join(dir, "config.json")
	if err := os.Symlink("/dev/zero", link); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{fifo, "/dev/null", "/dev/zero", link} {
		done := make(chan error, 1)
		go func() {
			_, err := ReadFile(p, 0)
			done <- err
		}()
		select {
		case err := <-done:
			if !errors.Is(err, ErrNotRegular) || !strings.Contains(err.Error(), "not a regular file") {
				t.Errorf("%s: err %v, want a not-a-regular-file error", p, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: ReadFile blocked", p)
		}
	}
	if _, err := ReadFile(fifo, 0); err == nil || !strings.Contains(err.Error(), "FIFO") {
		t.Errorf("FIFO error does not say FIFO: %v", err)
	}
	if _, err := CheckDir(fifo); err == nil {
		t.Error("CheckDir accepted a FIFO")
	}
}

func TestReadFileCap(t *testing.T) {
	p := filepath.Join(t.TempDir(), "tol.json")
	if err := os.WriteFile(p, bytes.Repeat([]byte("x"), 100), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(p, 100); err != nil || len(b) != 100 {
		t.Errorf("at the cap: %d bytes, %v", len(b), err)
	}
	if _, err := ReadFile(p, 99); !errors.Is(err, ErrTooLarge) {
		t.Errorf("over the cap: %v", err)
	}
}

func TestDescribe(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	os.Symlink(b, a)
	os.Symlink(a, b)
	_, err := ReadFile(a, 0)
	if err == nil || !strings.Contains(err.Error(), "too many levels of symbolic links") {
		t.Errorf("loop: %v", err)
	}
	_, err = ReadFile(filepath.Join(dir, "none\x1b[31m"), 0)
	if err == nil || !strings.Contains(err.Error(), "no such file") || strings.Contains(err.Error(), "\x1b") {
		t.Errorf("missing: %v", err)
	}
	for errno, want := range map[syscall.Errno]string{syscall.EMFILE: "too many open files", syscall.EACCES: "permission denied", syscall.ENFILE: "too many open files"} {
		err := Describe("x", &fs.PathError{Op: "open", Path: "x", Err: errno})
		if !strings.Contains(err.Error(), want) || !errors.Is(err, errno) {
			t.Errorf("%v: %v", errno, err)
		}
	}
	if os.Geteuid() != 0 {
		p := filepath.Join(dir, "secret")
		os.WriteFile(p, []byte("x"), 0o000)
		if _, err := ReadFile(p, 0); err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("unreadable: %v", err)
		}
	}
}

// tree makes an input dump directory A and returns its path.
func tree(t *testing.T) (root, a string) {
	root = t.TempDir()
	a = filepath.Join(root, "A")
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"dump.smd", "weights.safetensors", "config.json"} {
		if err := os.WriteFile(filepath.Join(a, f), []byte("input "+f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root, a
}

func TestGuardRefusesInputs(t *testing.T) {
	root, a := tree(t)
	w := filepath.Join(a, "weights.safetensors")
	// B: what cp -as and cp -al leave.
	bs, bh := filepath.Join(root, "Bs"), filepath.Join(root, "Bh")
	os.Mkdir(bs, 0o755)
	os.Mkdir(bh, 0o755)
	for _, f := range []string{"dump.smd", "weights.safetensors", "config.json"} {
		if err := os.Symlink(filepath.Join(a, f), filepath.Join(bs, f)); err != nil {
			t.Fatal(err)
		}
		if err := os.Link(filepath.Join(a, f), filepath.Join(bh, f)); err != nil {
			t.Fatal(err)
		}
	}
	linkDir := filepath.Join(root, "linkA")
	os.Symlink(a, linkDir)
	g, err := NewGuard(a)
	if err != nil {
		t.Fatal(err)
	}
	refused := []string{
		w, a, filepath.Join(a, "report.html"), filepath.Join(a, "sub", "x.html"),
		filepath.Join(bs, "weights.safetensors"), filepath.Join(bh, "weights.safetensors"),
		filepath.Join(linkDir, "new.html"), filepath.Join(root, "linkA", "..", "A", "x"),
		root, // holds the input
	}
	for _, p := range refused {
		if err := g.Check(p); !errors.Is(err, ErrOutput) {
			t.Errorf("Check(%s) = %v, want a refusal", p, err)
		}
	}
	// Only the input file as input: its directory's other files are fine.
	g2, _ := NewGuard(w)
	if err := g2.Check(filepath.Join(a, "report.html")); err != nil {
		t.Errorf("a new file beside a file input: %v", err)
	}
	if err := g2.Check(filepath.Join(bh, "weights.safetensors")); !errors.Is(err, ErrOutput) {
		t.Errorf("hard link to the input file accepted: %v", err)
	}
	if err := g.Check(filepath.Join(root, "out.html")); err != nil {
		t.Errorf("a fresh path: %v", err)
	}
	// Nothing was written by any of this.
	if b, _ := os.ReadFile(w); string(b) != "input weights.safetensors" {
		t.Fatal("input changed")
	}
}

func TestWriteFileAtomic(t *testing.T) {
	root, a := tree(t)
	g, _ := NewGuard(a)
	out := filepath.Join(root, "report.html")
	if err := os.WriteFile(out, []byte("old report"), 0o644); err != nil {
		t.Fatal(err)
	}
	write := func(w io.Writer) error {
		for i := 0; i < 100; i++ {
			if _, err := w.Write(bytes.Repeat([]byte("x"), 1<<16)); err != nil {
				return err
			}
		}
		return nil
	}
	restore := FailWritesAfter(1 << 20)
	err := g.WriteFile(out, 0o644, write)
	restore()
	if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("full disk: %v", err)
	}
	if b, _ := os.ReadFile(out); string(b) != "old report" {
		t.Errorf("full disk changed the old file: %d bytes", len(b))
	}
	ents, _ := os.ReadDir(root)
	if len(ents) != 2 {
		t.Errorf("left behind: %v", ents)
	}
	if err := g.WriteFile(out, 0o644, write); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(out); fi.Size() != 100<<16 {
		t.Errorf("written %d bytes", fi.Size())
	}
	// An error of the writer itself also leaves nothing.
	if err := g.WriteFile(filepath.Join(root, "new.html"), 0o644, func(io.Writer) error { return errors.New("boom") }); err == nil {
		t.Error("writer error lost")
	}
	if _, err := os.Stat(filepath.Join(root, "new.html")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("a failed write left its file")
	}
	// Through a symbolic link to an input: refused, input intact.
	ln := filepath.Join(root, "ln.html")
	os.Symlink(filepath.Join(a, "weights.safetensors"), ln)
	if err := g.WriteFile(ln, 0o644, write); !errors.Is(err, ErrOutput) {
		t.Errorf("link to input: %v", err)
	}
}

// The rule of an output file (OutputFile): a new path is written; an
// existing file only when it is the command's own output or with Force; a
// directory, an input or a missing directory never; every refusal names the
// path the user gave (never a temporary) and says what to do.
func TestOutputFileRule(t *testing.T) {
	root, a := tree(t)
	g, _ := NewGuard(a)
	own := OutputFile{Own: func(h []byte) bool { return bytes.HasPrefix(h, []byte("OWN")) }, What: "a test output"}
	write := func(s string) func(io.Writer) error {
		return func(w io.Writer) error { _, err := io.WriteString(w, s); return err }
	}
	out := filepath.Join(root, "out.txt")
	if err := g.WriteOutputFile(out, 0o644, own, write("OWN 1")); err != nil {
		t.Fatalf("new path: %v", err)
	}
	if err := g.WriteOutputFile(out, 0o644, own, write("OWN 2")); err != nil {
		t.Fatalf("own output: %v", err)
	}
	user := filepath.Join(root, "notes.txt")
	os.WriteFile(user, []byte("my notes"), 0o644)
	err := g.WriteOutputFile(user, 0o644, own, write("OWN"))
	if !errors.Is(err, ErrExists) || !errors.Is(err, ErrOutput) || !strings.Contains(err.Error(), user+": ") ||
		!strings.Contains(err.Error(), "not a test output") || !strings.Contains(err.Error(), "--force") {
		t.Errorf("a user's file: %v", err)
	}
	if b, _ := os.ReadFile(user); string(b) != "my notes" {
		t.Fatalf("a user's file was replaced: %q", b)
	}
	if err := g.WriteOutputFile(user, 0o644, OutputFile{}, write("OWN")); !errors.Is(err, ErrExists) {
		t.Errorf("no Own (nothing recognisable): %v", err)
	}
	forced := own
	forced.Force = true
	if err := g.WriteOutputFile(user, 0o644, forced, write("OWN forced")); err != nil {
		t.Errorf("--force: %v", err)
	}
	for _, c := range []struct{ path, want string }{
		{filepath.Join(a, "weights.safetensors"), "an input"},
		{root, "is a directory; give the path of a file"},
		{filepath.Join(root, "no-such-dir", "x.html"), "x.html: cannot be written: the directory " + filepath.Join(root, "no-such-dir") + " does not exist"},
	} {
		err := g.WriteOutputFile(c.path, 0o644, forced, write("OWN"))
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), ".tmp-") {
			t.Errorf("%s: %v, want %q", c.path, err, c.want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(a, "weights.safetensors")); string(b) != "input weights.safetensors" {
		t.Fatal("an input was replaced")
	}
	// A temporary cannot be made (a read-only directory; a name so long
	// that the temporary's, longer, is too long): the error names the
	// output, not the temporary.
	ro := filepath.Join(root, "ro")
	os.Mkdir(ro, 0o555)
	outs := []string{filepath.Join(root, strings.Repeat("n", 250))}
	if os.Geteuid() != 0 {
		outs = append(outs, filepath.Join(ro, "x.html"))
	}
	for _, o := range outs {
		err := g.WriteOutputFile(o, 0o644, own, write("OWN"))
		if err == nil || !strings.Contains(err.Error(), o+": ") || strings.Contains(err.Error(), ".tmp-") {
			t.Errorf("no temporary: %v", err)
		}
	}
}

func TestCreateDir(t *testing.T) {
	root, a := tree(t)
	g, _ := NewGuard(a)
	write := func(d *Dir, names ...string) {
		for _, n := range names {
			if err := d.WriteFile(n, 0o644, func(w io.Writer) error { _, err := io.WriteString(w, "new "+n); return err }); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The input directory itself, and a non-empty directory of the user's.
	if _, err := g.CreateDir(a); !errors.Is(err, ErrOutput) {
		t.Errorf("input dir: %v", err)
	}
	user := filepath.Join(root, "user")
	os.Mkdir(user, 0o755)
	os.WriteFile(filepath.Join(user, "notes.txt"), []byte("mine"), 0o644)
	if _, err := g.CreateDir(user); !errors.Is(err, ErrOutput) || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("user dir: %v", err)
	}
	// A new directory, then replacing it (ours), then a user file in it.
	out := filepath.Join(root, "out", "synth")
	d, err := g.CreateDir(out)
	if err != nil {
		t.Fatal(err)
	}
	write(d, "dump.smd", "config.json")
	if _, err := os.Stat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Error("destination exists before Commit")
	}
	if err := d.Commit(); err != nil {
		t.Fatal(err)
	}
	d.Abort()
	if b, _ := os.ReadFile(filepath.Join(out, "dump.smd")); string(b) != "new dump.smd" {
		t.Errorf("after commit: %q", b)
	}
	d, err = g.CreateDir(out)
	if err != nil {
		t.Fatalf("replacing our own output: %v", err)
	}
	write(d, "dump.smd")
	if err := d.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(out, "config.json")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("old output's file survived the replacement")
	}
	os.WriteFile(filepath.Join(out, "mine.txt"), []byte("mine"), 0o644)
	if _, err := g.CreateDir(out); !errors.Is(err, ErrOutput) {
		t.Errorf("our dir with a user file in it: %v", err)
	}
	os.Remove(filepath.Join(out, "mine.txt"))
	// A full disk: nothing partial, old output intact.
	d, err = g.CreateDir(out)
	if err != nil {
		t.Fatal(err)
	}
	restore := FailWritesAfter(3)
	err = d.WriteFile("dump.smd", 0o644, func(w io.Writer) error { _, err := io.WriteString(w, "0123456789"); return err })
	restore()
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("full disk: %v", err)
	}
	d.Abort()
	if b, _ := os.ReadFile(filepath.Join(out, "dump.smd")); string(b) != "new dump.smd" {
		t.Errorf("old output changed: %q", b)
	}
	ents, _ := os.ReadDir(filepath.Dir(out))
	if len(ents) != 1 {
		t.Errorf("left behind: %v", ents)
	}
	// Output dirs made of links to the input (cp -as): not ours, refused.
	bs := filepath.Join(root, "Bs")
	os.Mkdir(bs, 0o755)
	os.Symlink(filepath.Join(a, "dump.smd"), filepath.Join(bs, "dump.smd"))
	if _, err := g.CreateDir(bs); !errors.Is(err, ErrOutput) {
		t.Errorf("dir of links: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(a, "dump.smd")); string(b) != "input dump.smd" {
		t.Fatal("input changed")
	}
	// An empty existing directory is used.
	empty := filepath.Join(root, "empty")
	os.Mkdir(empty, 0o755)
	d, err = g.CreateDir(empty)
	if err != nil {
		t.Fatal(err)
	}
	write(d, "x.smd")
	if err := d.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(empty, "x.smd")); err != nil {
		t.Error(err)
	}
}

// TestCreateDirRefusesLinkedCopy: a copy of an earlier output made with
// hard links (cp -al, marker included) is someone's view of that output: as
// an output directory of a command reading the original, it is refused.
func TestCreateDirRefusesLinkedCopy(t *testing.T) {
	root := t.TempDir()
	a := filepath.Join(root, "A")
	d, err := (&Guard{}).CreateDir(a)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.WriteFile("dump.smd", 0o644, func(w io.Writer) error { _, err := io.WriteString(w, "x"); return err }); err != nil {
		t.Fatal(err)
	}
	if err := d.Commit(); err != nil {
		t.Fatal(err)
	}
	b := filepath.Join(root, "B")
	os.Mkdir(b, 0o755)
	for _, n := range []string{"dump.smd", Marker} {
		if err := os.Link(filepath.Join(a, n), filepath.Join(b, n)); err != nil {
			t.Fatal(err)
		}
	}
	g, _ := NewGuard(a)
	if _, err := g.CreateDir(b); !errors.Is(err, ErrOutput) || !strings.Contains(err.Error(), "a link to the input") {
		t.Errorf("hard-linked copy: %v", err)
	}
	if _, err := (&Guard{}).CreateDir(b); err != nil {
		t.Errorf("without the input in the guard the copy is an earlier output: %v", err)
	}
}

// Quote writes a name of at most 64 bytes whole, a longer one cut to 64
// bytes with its length.
func TestQuote(t *testing.T) {
	long := strings.Repeat("ab", 40)
	for _, c := range []struct{ in, want string }{
		{"kv_cache", `"kv_cache"`},
		{"a\nb", `"a\nb"`},
		{long[:64], `"` + long[:64] + `"`},
		{long, `"` + long[:64] + `"… (80 bytes)`},
	} {
		if got := Quote(c.in); got != c.want {
			t.Errorf("Quote(%q) = %s, want %s", c.in, got, c.want)
		}
	}
}

// Clip writes a string of at most 64 bytes as is (as %s does), a longer
// one cut to at most 64 bytes, on a character boundary, with its length.
func TestClip(t *testing.T) {
	long := strings.Repeat("ab", 40)
	wide := strings.Repeat("é", 40) // 2 bytes a character: byte 64 starts one
	odd := "a" + wide               // byte 64 is the second byte of an é
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"kv_cache", "kv_cache"},
		{"a\nb", "a\nb"},
		{long[:64], long[:64]},
		{long, long[:64] + "… (80 bytes)"},
		{wide, wide[:64] + "… (80 bytes)"},
		{odd, odd[:63] + "… (81 bytes)"},
	} {
		if got := Clip(c.in); got != c.want {
			t.Errorf("Clip(%q) = %q, want %q", c.in, got, c.want)
		}
		if len(c.in) <= 64 && Clip(c.in) != fmt.Sprintf("%s", c.in) {
			t.Errorf("Clip(%q) differs from %%s", c.in)
		}
	}
	if got := Clip(strings.Repeat("x", 4<<20)); len(got) > 100 {
		t.Errorf("Clip of 4 MiB: %d bytes", len(got))
	}
}

// Dims writes a shape of at most 8 dimensions as %v does, a longer one as
// its first 8 and its rank.
func TestDims(t *testing.T) {
	for _, s := range [][]int{nil, {}, {7}, {2, 3, 4}, {1, 2, 3, 4, 5, 6, 7, 8}} {
		if got, want := Dims(s), fmt.Sprint(s); got != want {
			t.Errorf("Dims(%v) = %q, want %q", s, got, want)
		}
	}
	if got, want := Dims([]int64{-1, 2, 3, 4, 5, 6, 7, 8, 9}), "[-1 2 3 4 5 6 7 8 …] (9 dims)"; got != want {
		t.Errorf("Dims of 9 = %q, want %q", got, want)
	}
	huge := make([]int, 500000)
	if got := Dims(huge); got != "[0 0 0 0 0 0 0 0 …] (500000 dims)" {
		t.Errorf("Dims of 500000 = %q", got)
	}
}

// JSONError cuts the number and the unknown field name that encoding/json
// echo, and leaves a normal-sized error as it was.
func TestJSONError(t *testing.T) {
	type shape struct {
		Shape []int `json:"shape"`
	}
	long := strings.Repeat("7", 1<<20)
	var s shape
	err := json.Unmarshal([]byte(`{"shape":[`+long+`]}`), &s)
	got := JSONError(err)
	if want := `json: cannot unmarshal number ` + long[:64] + `… (1048576 bytes) into Go struct field shape.shape of type int`; got.Error() != want {
		t.Errorf("number: %q, want %q", got, want)
	}
	var te *json.UnmarshalTypeError
	if !errors.As(got, &te) {
		t.Errorf("number: %v does not wrap the *json.UnmarshalTypeError", got)
	}
	dec := json.NewDecoder(strings.NewReader(`{"` + long + `":1}`))
	dec.DisallowUnknownFields()
	err = dec.Decode(&s)
	if got, want := JSONError(err).Error(), `json: unknown field "`+long[:64]+`"… (1048576 bytes)`; got != want {
		t.Errorf("unknown field: %q, want %q", got, want)
	}
	for _, in := range []string{`{"shape":[true]}`, `{"shape":"x"}`, `{"sh":1}`, `{"shape":[1e400]}`, `{`} {
		dec := json.NewDecoder(strings.NewReader(in))
		dec.DisallowUnknownFields()
		err := dec.Decode(&s)
		if err == nil || JSONError(err) != err {
			t.Errorf("%s: JSONError(%v) changed a short error", in, err)
		}
	}
	if JSONError(nil) != nil {
		t.Error("JSONError(nil) != nil")
	}
}
