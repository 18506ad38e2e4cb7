package dump

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeSGLangPT writes what SGLang's dumper writes for one dump() call:
// torch.save({"value": tensor, "meta": {...}}) as a torch zip, protocol 2,
// with the opcode sequence torch 2.11 wrote for testdata/dump/pt/value_meta.pt
// (a test-only writer: it emits int32 1-d tensors and string/int meta).
func writeSGLangPT(t *testing.T, path string, vals []int32, meta [][2]interface{}) {
	t.Helper()
	var p bytes.Buffer
	str := func(s string) {
		p.WriteByte('X')
		binary.Write(&p, binary.LittleEndian, uint32(len(s)))
		p.WriteString(s)
	}
	p.Write([]byte{0x80, 2, '}', '('})
	str("value")
	p.WriteString("ctorch._utils\n_rebuild_tensor_v2\n((")
	str("storage")
	p.WriteString("ctorch\nIntStorage\n")
	str("0")
	str("cpu")
	p.Write([]byte{'K', byte(len(vals)), 't', 'Q', 'K', 0, 'K', byte(len(vals)), 0x85, 'K', 1, 0x85, 0x89})
	p.WriteString("ccollections\nOrderedDict\n)Rt")
	p.WriteByte('R')
	str("meta")
	p.Write([]byte{'}', '('})
	for _, kv := range meta {
		str(kv[0].(string))
		switch v := kv[1].(type) {
		case string:
			str(v)
		case int:
			p.WriteByte('J')
			binary.Write(&p, binary.LittleEndian, int32(v))
		}
	}
	p.Write([]byte{'u', 'u', '.'})
	prefix := filepath.Base(path[:len(path)-3])
	var z bytes.Buffer
	zw := zip.NewWriter(&z)
	for _, m := range []struct {
		name string
		data []byte
	}{{prefix + "/data.pkl", p.Bytes()}, {prefix + "/byteorder", []byte("little")}, {prefix + "/data/0", func() []byte {
		var b bytes.Buffer
		binary.Write(&b, binary.LittleEndian, vals)
		return b.Bytes()
	}()}} {
		w, err := zw.CreateHeader(&zip.FileHeader{Name: m.name, Method: zip.Store})
		if err != nil {
			t.Fatal(err)
		}
		w.Write(m.data)
	}
	zw.Close()
	if err := os.WriteFile(path, z.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// An SGLang dumper directory: file names are the ___-joined tags, steps are
// the dumper's counter and become positions through the positions records;
// the counter-0 step (a prefill with two positions) is left out; rank 1 is
// not read; meta is kept.
func TestSGLangDumperDir(t *testing.T) {
	dir := t.TempDir()
	idx := 0
	put := func(step, rank int, name string, layer int, vals []int32) {
		idx++
		tags := [][2]interface{}{{"step", step}, {"rank", rank}, {"dump_index", idx}, {"name", name}, {"recompute_status", "disabled"}}
		fn := "step=" + istr(step) + "___rank=" + istr(rank) + "___dump_index=" + istr(idx) + "___name=" + name + "___recompute_status=disabled"
		if layer >= 0 {
			tags = append(tags, [2]interface{}{"layer_id", layer})
			fn += "___layer_id=" + istr(layer)
		}
		tags = append(tags, [2]interface{}{"world_rank", rank}, [2]interface{}{"world_size", 2})
		writeSGLangPT(t, filepath.Join(dir, fn+".pt"), vals, tags)
	}
	put(0, 0, "positions", -1, []int32{0, 1})
	put(0, 0, "non_intrusive__model.layers.0.self_attn.q_a_proj.output", 0, []int32{9, 9})
	for c, p := range []int32{2, 3} {
		put(c+1, 0, "positions", -1, []int32{p})
		put(c+1, 0, "input_ids", -1, []int32{100 + p})
		put(c+1, 0, "non_intrusive__model.layers.0.self_attn.q_a_proj.output", 0, []int32{p, -p})
		put(c+1, 0, "non_intrusive__model.layers.1.self_attn.kv_norm.output", 1, []int32{p})
		put(c+1, 1, "non_intrusive__model.layers.0.self_attn.q_a_proj.output", 0, []int32{p, -p})
		put(c+1, 0, "non_intrusive__model.layers.0.self_attn.rotary_emb.output", 0, []int32{1})
	}
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Map == nil || d.Map.Name != "sglang" {
		t.Fatalf("map %v", d.Map)
	}
	for _, p := range []int{2, 3} {
		for _, k := range []Key{{Step: p, Layer: 0, Stage: "q_a"}, {Step: p, Layer: 1, Stage: "kv_normed"}, {Step: p, Layer: Global, Stage: "pos"}, {Step: p, Layer: Global, Stage: "tok"}} {
			e, ok := d.Lookup(k, KindStage)
			if !ok {
				t.Fatalf("no %s; entries %v unmapped %v", k, d.Entries, d.Unmapped)
			}
			r, err := d.Read(e)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := r.Int64()
			if k.Stage == "q_a" && (len(v) != 2 || v[0] != int64(p)) || k.Stage == "pos" && v[0] != int64(p) {
				t.Errorf("%s = %v", k, v)
			}
			if e.Meta["name"] == "" || e.Meta["world_size"] != "2" {
				t.Errorf("%s meta %v", k, e.Meta)
			}
		}
	}
	if len(d.Entries) != 8 {
		t.Errorf("%d entries, want 8: %v", len(d.Entries), d.Entries)
	}
	var prefill, rope, rank1 int
	for _, u := range d.Unmapped {
		switch {
		case bytes.Contains([]byte(u), []byte("prefill")):
			prefill++
		case bytes.Contains([]byte(u), []byte("rotary_emb")):
			rope++
		case bytes.Contains([]byte(u), []byte("rank=1")):
			rank1++
		}
	}
	if prefill != 2 || rope != 2 || rank1 != 2 {
		t.Errorf("unmapped %v", d.Unmapped)
	}
}

func istr(i int) string {
	return string(appendInt(nil, i))
}

func appendInt(b []byte, i int) []byte {
	if i < 0 {
		b = append(b, '-')
		i = -i
	}
	if i >= 10 {
		b = appendInt(b, i/10)
	}
	return append(b, byte('0'+i%10))
}

// writePassPT writes what SGLang's older tensor dump hook
// (--debug-tensor-dump-output-folder, tensor_dump_forward_hook.py) writes per
// forward pass: torch.save({module name: tensor}) — int32 1-d tensors here,
// one storage each, opcodes as torch 2.11 writes them (protocol 2).
func writePassPT(t *testing.T, path string, names []string, vals [][]int32) {
	t.Helper()
	var p bytes.Buffer
	str := func(s string) {
		p.WriteByte('X')
		binary.Write(&p, binary.LittleEndian, uint32(len(s)))
		p.WriteString(s)
	}
	p.Write([]byte{0x80, 2, '}', '('})
	for i, n := range names {
		str(n)
		p.WriteString("ctorch._utils\n_rebuild_tensor_v2\n((")
		str("storage")
		p.WriteString("ctorch\nIntStorage\n")
		str(istr(i))
		str("cpu")
		p.Write([]byte{'K', byte(len(vals[i])), 't', 'Q', 'K', 0, 'K', 1, 'K', byte(len(vals[i])), 0x86, 'K', byte(len(vals[i])), 'K', 1, 0x86, 0x89})
		p.WriteString("ccollections\nOrderedDict\n)Rt")
		p.WriteByte('R')
	}
	p.Write([]byte{'u', '.'})
	prefix := "Pass"
	var z bytes.Buffer
	zw := zip.NewWriter(&z)
	w, _ := zw.CreateHeader(&zip.FileHeader{Name: prefix + "/data.pkl", Method: zip.Store})
	w.Write(p.Bytes())
	for i, v := range vals {
		w, _ := zw.CreateHeader(&zip.FileHeader{Name: prefix + "/data/" + istr(i), Method: zip.Store})
		binary.Write(w, binary.LittleEndian, v)
	}
	zw.Close()
	os.MkdirAll(filepath.Dir(path), 0o755)
	if err := os.WriteFile(path, z.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The older per-pass files: TP0_PP0_Rank0_pid<n>/Pass<k>.pt, positions from
// model.forward_batch_info.positions (a [1, n] tensor here: squeezed), the
// prefill pass (two positions) left out.
func TestSGLangTensorDumpDir(t *testing.T) {
	dir := t.TempDir()
	sub := filepath.Join(dir, "TP0_PP0_Rank0_pid42")
	writePassPT(t, filepath.Join(sub, "Pass00000.pt"), []string{"model.forward_batch_info.positions", "model.layers.0.self_attn.q_a_proj"}, [][]int32{{0, 1}, {5, 5}})
	writePassPT(t, filepath.Join(sub, "Pass00001.pt"), []string{"model.forward_batch_info.positions", "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_norm", "model.layers.0.self_attn.rotary_emb"}, [][]int32{{2}, {7, 8}, {1, 2}, {3}})
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Map.Name != "sglang-tensor-dump" {
		t.Fatalf("map %s (%s)", d.Map.Name, d.Detect)
	}
	r, err := d.Get(Key{Step: 2, Layer: 0, Stage: "q_a"}, KindStage)
	if err != nil {
		t.Fatalf("%v: %v / %v", err, d.Entries, d.Unmapped)
	}
	if v, _ := r.Int64(); len(v) != 2 || v[0] != 7 || len(r.Shape) != 1 {
		t.Errorf("q_a %v %v", r.Shape, v)
	}
	if _, ok := d.Lookup(Key{Step: 2, Layer: 0, Stage: "kv_normed"}, KindStage); !ok {
		t.Error("no kv_normed")
	}
	if len(d.Entries) != 3 {
		t.Errorf("entries %v", d.Entries)
	}
}

// A record whose value is not a tensor (SGLang dumps e.g. the request ids as
// a list of strings) is listed as unmapped, not an error for the directory.
func TestSGLangNonTensorValue(t *testing.T) {
	dir := t.TempDir()
	src := "../testdata/sglang-v4-tiny/sglang"
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join(src, e.Name()))
		os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644)
	}
	// {"value": ["r0"], "meta": {"name": "rids"}} as torch.save protocol 2 writes it
	var p bytes.Buffer
	str := func(s string) {
		p.WriteByte('X')
		binary.Write(&p, binary.LittleEndian, uint32(len(s)))
		p.WriteString(s)
	}
	p.Write([]byte{0x80, 2, '}', '('})
	str("value")
	p.Write([]byte{']', '('})
	str("r0")
	p.Write([]byte{'e'})
	str("meta")
	p.Write([]byte{'}', '('})
	str("name")
	str("rids")
	p.Write([]byte{'u', 'u', '.'})
	var z bytes.Buffer
	zw := zip.NewWriter(&z)
	w, _ := zw.CreateHeader(&zip.FileHeader{Name: "x/data.pkl", Method: zip.Store})
	w.Write(p.Bytes())
	zw.Close()
	os.WriteFile(filepath.Join(dir, "step=1___rank=0___dump_index=999___name=rids___recompute_status=disabled.pt"), z.Bytes(), 0o644)
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	found := false
	for _, u := range d.Unmapped {
		found = found || strings.Contains(u, "rids (value is not a tensor)")
	}
	if !found || len(d.Entries) != 114 {
		t.Errorf("%d entries; unmapped %v", len(d.Entries), d.Unmapped[len(d.Unmapped)-1])
	}
}
