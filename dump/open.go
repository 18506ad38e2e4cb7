package dump

import (
	"archive/zip"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"sparsemla/userfile"
)

// Entry is one record of a dump's index: its key and layout, and where its
// bytes lie. Reading it (Dump.Read) costs one ReadAt (or one member
// decompression for a deflated .npz).
type Entry struct {
	Key
	Kind   Kind
	Name   string // name in the source (tensor name, npz member, file)
	DType  DType
	Shape  []int
	NBytes int64
	Page   *PageInfo
	File   string // file the bytes live in
	Record int    // record number within File (frame index for native files)
	Offset int64  // byte offset of the data in File (-1 for compressed npz members)

	// Meta is the producer's metadata of a foreign record (SGLang's
	// "meta" dict and file-name tags, flattened to strings), or nil.
	Meta map[string]string
	// Shard marks a record that is one tensor-parallel rank's shard (nil:
	// whole); Open merges the shards of a key into one entry.
	Shard *ShardInfo

	src     int       // index into Dump.srcs
	pt      *ptTensor // strided or compressed torch.save tensor
	parts   []Entry   // tensor-parallel shards merged into this entry, in rank order
	view    []int     // name-map shape rule, applied after squeeze_leading
	fromDT  DType     // stored dtype before a name-map override
	npz     *zip.File // compressed npz member
	npyData int64     // offset of the array data inside a compressed npz member
}

// Dump is an opened dump of any supported format, indexed by key. Only the
// index is in memory; records are read on demand.
type Dump struct {
	Path     string
	Format   string // "native", "safetensors", "npy", "npz"
	Header   Header
	Map      *NameMap // the name map used (nil for native dumps)
	Entries  []Entry  // in file order
	Prefix   []PrefixHit
	Unmapped []string // "file: name" of tensors no map rule matched
	// Window, for a window of dumped steps without a prefill state
	// (NameMap.FirstStepState), says what became of its first step: its
	// cache states became the start state, its other records were left out
	// (each is also in Unmapped). Nil otherwise.
	Window *WindowStart
	// Incomplete lists native files without an end frame (cut short at a
	// frame boundary, e.g. by a crashed capture); their records are intact.
	Incomplete []string
	// Detect says why the name map of a foreign directory was chosen: the
	// built-in map detected, or for each built-in map the detect rule that
	// failed (e.g. "official-v4-tiny: no prefill_state.safetensors").
	Detect string

	byKey map[entryID]int
	srcs  []io.ReaderAt  // the bytes of each file, by Entry.src
	files []*os.File     // the files Open opened (closed by Close)
	meta  foreignMeta    // request / prefix metadata of a foreign dump
	tp    map[string]int // native file -> header producer tp_rank
}

// WindowStart is the first step of a window of dumped steps without a
// prefill state: nothing says the state before it, so it is not replayed;
// States of its records became the start state (kind state, valid after
// Step) and LeftOut were left out.
type WindowStart struct {
	Step    int
	States  int
	LeftOut int
}

// WeightsFile is the model weights file a dump directory may hold beside its
// records (official state_dict names; replay.LoadModel reads it). In a
// directory of native .smd files it is not part of the dump.
const WeightsFile = "weights.safetensors"

// Open opens a dump: a native file or directory of *.smd files (with, or
// without, WeightsFile and config.json beside them), a safetensors file or
// directory, an .npz file, or a directory of .npy/.npz files. Non-native dumps use the built-in name map detected for the
// directory (e.g. official-v4-tiny), else the generic map.
func Open(path string) (*Dump, error) { return OpenMapped(path, nil) }

// OpenMapped is Open with an explicit name map for non-native dumps; a map
// given for a native dump is an error (it would be ignored).
func OpenMapped(path string, m *NameMap) (*Dump, error) {
	fi, err := userfile.CheckFileOrDir(path)
	if err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	d := &Dump{Path: path, byKey: map[entryID]int{}}
	root, files, err := dumpFiles(path, fi.IsDir())
	if err != nil {
		return nil, err
	}
	files, sniffed, formats, err := sniffFormats(path, root, files, fi.IsDir())
	if err != nil {
		return nil, err
	}
	if !formats["native"] {
		if err := d.foreignSetup(path, fi.IsDir(), m); err != nil {
			return nil, err
		}
	} else if m != nil {
		// a native dump's names are sparsemla's own: a map given for it
		// would be ignored while the user believes it applied
		return nil, fmt.Errorf("dump: %s: a native sparsemla dump (.smd), whose names need no map: leave the name map (%s) out", path, userfile.Clip(m.Name))
	}
	ok := false
	defer func() {
		if !ok {
			d.Close()
		}
	}()
	prevFix, err := d.addFiles(root, files, sniffed, formats)
	if err != nil {
		return nil, err
	}
	if len(prevFix) > 0 && d.Map != nil && d.Map.StepStage != "" {
		return nil, fmt.Errorf("dump: %s: name map %s: state_after_prev files cannot be combined with step_stage", path, userfile.Clip(d.Map.Name))
	}
	if err := d.finishForeign(path, root); err != nil {
		return nil, err
	}
	if len(prevFix) > 0 {
		if err := d.fixPrevSteps(path, prevFix); err != nil {
			return nil, err
		}
	}
	if err := d.mergeShards(); err != nil {
		return nil, err
	}
	if err := d.indexKeys(); err != nil {
		return nil, err
	}
	ok = true
	return d, nil
}

// dumpFiles lists the files of the dump at path, relative to root: the file
// itself, or a directory's dump files (two levels deep at most), sorted.
func dumpFiles(path string, isDir bool) (root string, files []string, err error) {
	if !isDir {
		return filepath.Dir(path), []string{filepath.Base(path)}, nil
	}
	err = filepath.WalkDir(path, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(path, p)
		if de.IsDir() {
			if strings.Count(filepath.ToSlash(rel), "/") >= 2 {
				return filepath.SkipDir
			}
			return nil
		}
		switch strings.ToLower(filepath.Ext(p)) {
		case ".smd", ".safetensors", ".npy", ".npz", ".pt", ".pth":
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		return "", nil, fmt.Errorf("dump: %w", userfile.Describe(path, err))
	}
	sort.Strings(files)
	if len(files) == 0 {
		return "", nil, fmt.Errorf("dump: %s: no .smd, .safetensors, .npy, .npz or .pt files", path)
	}
	return path, files, nil
}

// sniffFormats reads the format of every file (relative path -> format) and
// the set of formats; the model weights beside a native dump's records are
// dropped from files, and native files mixed with other formats are refused.
func sniffFormats(path, root string, files []string, isDir bool) ([]string, map[string]string, map[string]bool, error) {
	formats := map[string]bool{}
	sniffed := map[string]string{} // relative path -> format
	for _, f := range files {
		format, err := formatOf(filepath.Join(root, f))
		if err != nil {
			return nil, nil, nil, fmt.Errorf("dump: %w", err)
		}
		sniffed[f] = format
		formats[format] = true
	}
	if formats["native"] && isDir {
		// A native dump directory may hold the model weights beside the
		// .smd files (as synth and fault write it): they are not records.
		kept := files[:0]
		for _, f := range files {
			if f != WeightsFile {
				kept = append(kept, f)
			}
		}
		files = kept
		formats = map[string]bool{}
		for _, f := range files {
			formats[sniffed[f]] = true
		}
	}
	if formats["native"] && len(formats) > 1 {
		return nil, nil, nil, fmt.Errorf("dump: %s: mixes native .smd files with other formats", path)
	}
	return files, sniffed, formats, nil
}

// foreignSetup prepares the reading of a foreign dump: its name map (m, else
// detected for a directory, else generic), the sidecar and the model config
// the map names.
func (d *Dump) foreignSetup(path string, isDir bool, m *NameMap) error {
	if m == nil && isDir {
		m = DetectNameMap(path)
		d.Detect = detectReport(path, m)
	}
	if m == nil {
		m, _ = BuiltinNameMap("generic")
	}
	d.Map = m
	if err := d.loadSidecar(path, isDir); err != nil {
		return err
	}
	if m.Config != "" && isDir {
		// A missing config is not an error here (the replay says what it
		// needs); one that is there but unreadable is.
		p := filepath.Join(path, m.Config)
		if _, err := os.Lstat(p); err == nil {
			cfg, err := userfile.ReadFile(p, MaxConfigJSON)
			if err != nil {
				return fmt.Errorf("dump: %w", err)
			}
			if cfg, err = d.configArgs(cfg, p); err != nil {
				return err
			}
			d.Header.ModelArgs = string(cfg)
			d.Header.CompressRatios = compressRatios(cfg)
		}
	}
	return nil
}

// addFiles reads the records of every file in its format and sets d.Format;
// it returns the entries whose step is "the step before the first dumped
// step" (fixed by fixPrevSteps).
func (d *Dump) addFiles(root string, files []string, sniffed map[string]string, formats map[string]bool) ([]int, error) {
	var prevFix []int
	for _, rel := range files {
		full := filepath.Join(root, rel)
		format := sniffed[rel]
		d.Format = format
		if len(formats) > 1 {
			d.Format = "mixed"
		}
		var err error
		switch format {
		case "native":
			err = d.addNative(full)
		case "safetensors":
			err = d.addSafetensors(full, rel, &prevFix)
		case "npz":
			err = d.addNpz(full, rel, &prevFix)
		case "npy":
			err = d.addNpy(full, rel, &prevFix)
		case "pt":
			err = d.addPT(full, rel, &prevFix)
		default:
			err = fmt.Errorf("dump: %s: unrecognised file (want a sparsemla dump, safetensors, .npy, .npz or a torch.save .pt)", userfile.Escape(full))
		}
		if err != nil {
			return nil, err
		}
	}
	if len(formats) == 1 {
		for f := range formats {
			d.Format = f
		}
	}
	return prevFix, nil
}

// fixPrevSteps gives the entries of prevFix the step before the first dumped
// step.
func (d *Dump) fixPrevSteps(path string, prevFix []int) error {
	first := -1
	for _, e := range d.Entries {
		if e.Kind == KindStage && e.Step != NoStep && (first < 0 || e.Step < first) {
			first = e.Step
		}
	}
	if first < 0 {
		return fmt.Errorf("dump: %s: state files are valid 'after the step before the first dumped step', but no step was dumped", path)
	}
	for _, i := range prevFix {
		d.Entries[i].Step = first - 1
	}
	return nil
}

// indexKeys indexes the entries by key and kind, refusing duplicates.
func (d *Dump) indexKeys() error {
	for i := range d.Entries {
		e := &d.Entries[i]
		if err := e.Key.checkStrings(); err != nil {
			return fmt.Errorf("dump: %s: record %d (%s) at offset %d: %w", e.File, e.Record, userfile.Clip(e.Name), e.Offset, err)
		}
		id := entryID{e.Key, e.Kind}
		if j, dup := d.byKey[id]; dup {
			p := &d.Entries[j]
			return fmt.Errorf("dump: %s: record %d (%s) at offset %d: duplicate of %s record %d (%s %s)", e.File, e.Record, userfile.Clip(e.Name), e.Offset, p.File, p.Record, clipKey(id.Key), id.Kind)
		}
		d.byKey[id] = i
	}
	return nil
}

// MaxConfigJSON bounds the config.json a name map names (a real one is a
// few KiB).
const MaxConfigJSON = 4 << 20

// formatOf sniffs a file's format from its first bytes. The file must be a
// regular file that can be opened: anything else is an error saying what
// it is (a FIFO, permission denied, ...), never "unrecognised".
func formatOf(path string) (string, error) {
	f, _, err := userfile.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var b [8]byte
	n, err := io.ReadFull(f, b[:])
	if err != nil && err != io.EOF && err != io.ErrUnexpectedEOF {
		return "", userfile.Describe(path, err)
	}
	switch {
	case n >= 8 && string(b[:]) == Magic:
		return "native", nil
	case n >= 6 && string(b[:6]) == npyMagic:
		return "npy", nil
	case n >= 4 && string(b[:4]) == "PK\x03\x04":
		return zipFormat(f), nil
	case strings.HasSuffix(path, ".safetensors"):
		return "safetensors", nil
	case strings.HasSuffix(path, ".smd"):
		return "native", nil // lets the native reader report the bad magic
	}
	return "unknown", nil
}

func (d *Dump) addSource(path string) (*os.File, int64, int, error) {
	f, fi, err := userfile.Open(path)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("dump: %w", err)
	}
	d.files = append(d.files, f)
	d.srcs = append(d.srcs, f)
	return f, fi.Size(), len(d.srcs) - 1, nil
}
