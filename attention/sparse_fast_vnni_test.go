package attention

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"sparsemla/quant"
)

func needVNNI(t *testing.T) {
	t.Helper()
	if !HasVNNI() {
		t.Skip("no AVX-512 VNNI on this machine/build: the integer index products not run")
	}
}

// The kernels read vnniQuery at fixed byte offsets.
func TestVNNIQueryLayout(t *testing.T) {
	var q vnniQuery
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{{"panel", unsafe.Offsetof(q.panel), 0}, {"corr", unsafe.Offsetof(q.corr), 8192}, {"shift", unsafe.Offsetof(q.shift), 9216},
		{"emin", unsafe.Offsetof(q.emin), 10240}, {"w", unsafe.Offsetof(q.w), 10496}, {"maxSq", unsafe.Offsetof(q.maxSq), 10752}} {
		if c.got != c.want {
			t.Errorf("vnniQuery.%s at %d, the kernels read it at %d", c.name, c.got, c.want)
		}
	}
}

// vnniRows makes rows of 128 values of every kind the packing must tell
// apart, with whether vnniPackRowRef should take them at limit 9.
func vnniRows(rng *rand.Rand) (rows [][]float32, names []string) {
	add := func(name string, v []float32) { rows, names = append(rows, v), append(names, name) }
	fq4 := func(scale float64) []float32 {
		v := bf16Vec(rng, 128, scale)
		quant.FQ4(v, 32)
		return v
	}
	for i := 0; i < 20; i++ {
		add(fmt.Sprint("fq4 ", i), fq4(math.Pow(2, float64(rng.IntN(30)-15))))
	}
	// block exponents spread by s (block b scaled by 2^(s·b/3) rounded)
	for s := 0; s <= 12; s++ {
		v := fq4(1)
		for b := 0; b < 4; b++ {
			for i := b * 32; i < (b+1)*32; i++ {
				v[i] = float32(math.Ldexp(float64(v[i]), s*b/3))
			}
		}
		add(fmt.Sprint("spread ", s), v)
	}
	v := fq4(1)
	v[40] = v[40] * 1.0078125 // off its block's grid (unless it was 0)
	if v[40] == 0 {
		v[40] = 0.1
	}
	add("off grid", v)
	v = fq4(1)
	for i := 32; i < 64; i++ {
		v[i] = 0
	}
	add("zero block", v)
	v = fq4(1)
	for i := 0; i < 32; i++ {
		v[i] = float32(math.Copysign(0, -1))
	}
	add("-0 block", v)
	add("zero row", make([]float32, 128))
	for _, x := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		v = fq4(1)
		v[77] = float32(x)
		add(fmt.Sprint("non-finite ", x), v)
	}
	// 13 = not an E2M1 value, still an integer code (|n| ≤ 15)
	v = fq4(1)
	v[3] = 13 * float32(math.Ldexp(1, 0))
	for i := 0; i < 32; i++ {
		v[i] = float32(math.Round(float64(v[i])))
	}
	add("code 13", v)
	// the exponent bounds: E = floor(log2 max) in [−57, 43]
	for _, e := range []int{43, 44, -57, -58, -140} {
		v = make([]float32, 128)
		for i := range v {
			v[i] = float32(math.Ldexp(float64(rng.IntN(31)-15), e-3))
		}
		v[0] = float32(math.Ldexp(8, e-3)) // max |v| = 2^e·…: E = e
		for i := range v {
			if math.Abs(float64(v[i])) > math.Ldexp(8, e-3) {
				v[i] = float32(math.Ldexp(8, e-3))
			}
		}
		add(fmt.Sprint("exponent ", e), v)
	}
	return rows, names
}

// vnniPackRows (assembly) writes the records vnniPackRowRef does, and takes
// the same rows, at every limit.
func TestVNNIPackRowsEqualRef(t *testing.T) {
	needVNNI(t)
	rng := rand.New(rand.NewPCG(20, 21))
	rows, names := vnniRows(rng)
	taken := 0
	for limit := 0; limit <= vnniSpread; limit++ {
		for i, row := range rows {
			want, got := make([]byte, vnniRecord), make([]byte, vnniRecord)
			wok := vnniPackRowRef(want, row, limit)
			gok := vnniPackRows(&got[0], &row[0], 1, limit) == 1
			if wok != gok {
				t.Errorf("limit %d, %s: assembly takes it %v, reference %v", limit, names[i], gok, wok)
				continue
			}
			if !wok {
				if got[vnniRecTaken] != 0 {
					t.Errorf("limit %d, %s: not taken but flagged", limit, names[i])
				}
				continue
			}
			taken++
			if !bytes.Equal(got, want) {
				t.Errorf("limit %d, %s: record differs\n got %x\nwant %x", limit, names[i], got, want)
			}
		}
	}
	// what the cases are for: these must be taken at limit 9, those not
	want := map[string]bool{"fq4 0": true, "spread 0": true, "spread 9": true, "spread 10": false, "off grid": false,
		"zero block": true, "-0 block": true, "zero row": false, "non-finite NaN": false, "non-finite +Inf": false,
		"code 13": true, "exponent 43": true, "exponent 44": false, "exponent -57": true, "exponent -58": false, "exponent -140": false}
	for i, row := range rows {
		w, ok := want[names[i]]
		if !ok {
			continue
		}
		if got := vnniPackRowRef(make([]byte, vnniRecord), row, vnniSpread); got != w {
			t.Errorf("%s: taken %v, want %v", names[i], got, w)
		}
	}
	if taken == 0 {
		t.Fatal("no row taken")
	}
}

// vnniVerifyRows passes a record only for the row it was packed from.
func TestVNNIVerifyRows(t *testing.T) {
	needVNNI(t)
	rng := rand.New(rand.NewPCG(22, 23))
	rows, names := vnniRows(rng)
	for i, row := range rows {
		rec := make([]byte, vnniRecord)
		ok := vnniPackRows(&rec[0], &row[0], 1, vnniSpread) == 1
		if got := vnniVerifyRows(&rec[0], &row[0], 1, vnniSpread) == 1; got != ok {
			t.Errorf("%s: packed %v, verified %v", names[i], ok, got)
		}
		if !ok {
			continue
		}
		spread := int(rec[vnniRecSpread])
		if spread > 0 && vnniVerifyRows(&rec[0], &row[0], 1, spread-1) != 0 {
			t.Errorf("%s: verified under a limit below its spread %d", names[i], spread)
		}
		// every single value changed (to another value of its grid, or off it)
		for k := 0; k < 128; k += 7 {
			for _, nv := range []float32{row[k] + float32(math.Ldexp(1, int(int8(rec[vnniRecEmin])))), row[k] * 1.5, -row[k], float32(math.NaN())} {
				if nv == row[k] || (row[k] == 0 && nv == 0) {
					continue
				}
				old := row[k]
				row[k] = nv
				if vnniVerifyRows(&rec[0], &row[0], 1, vnniSpread) != 0 {
					t.Errorf("%s: value %d changed %g → %g, record still verified", names[i], k, old, nv)
				}
				row[k] = old
			}
		}
	}
}

// indexTerms64VNNI writes, for the rows in done, the terms the fp32 kernel
// does, and leaves the others alone: every done pattern of 8 rows.
func TestIndexTerms64VNNIEqualsAVX512(t *testing.T) {
	needVNNI(t)
	rng := rand.New(rand.NewPCG(24, 25))
	const hd = 128
	iq, ic, w := bf16Vec(rng, 64*hd, 1), bf16Vec(rng, 8*hd, 1), bf16Vec(rng, 64, 0.1)
	quant.FQ4(iq, 32)
	quant.FQ4(ic, 32)
	q, ok := packVNNIQuery(iq, w)
	if !ok {
		t.Fatal("an FQ4 query not packed")
	}
	var recs [8 * vnniRecord]byte
	all := vnniPackRows(&recs[0], &ic[0], 8, vnniSpread-int(q.maxSq))
	if all != 0xff {
		t.Fatalf("FQ4 keys taken %08b, want all", all)
	}
	var want [8 * 64]float32
	iqT, _ := headPanels(iq, 64, hd)
	indexTerms64AVX512(&want[0], &ic[0], &iqT[0], &w[0], 8)
	for done := uint64(0); done < 256; done++ {
		for rows := 1; rows <= 8; rows++ {
			var got [8 * 64]float32
			for i := range got {
				got[i] = 12345
			}
			indexTerms64VNNI(&got[0], &recs[0], q, done, rows)
			for r := 0; r < 8; r++ {
				for h := 0; h < 64; h++ {
					g := got[r*64+h]
					if r < rows && done&(1<<r) != 0 {
						if math.Float32bits(g) != math.Float32bits(want[r*64+h]) {
							t.Fatalf("done %08b rows %d: term [%d][%d] = %g, fp32 kernel %g", done, rows, r, h, g, want[r*64+h])
						}
					} else if g != 12345 {
						t.Fatalf("done %08b rows %d: row %d written", done, rows, r)
					}
				}
			}
		}
	}
}

// The spread bound is what keeps the integer sum the reference's. A key
// whose blocks spread by 10 (query spread 0) can have partial sums past
// 2^24 units, where the reference's fp32 sum rounds at each add and the
// integer sum only once (its conversion); the search below finds such a key
// whose roundings show through the bf16 of q·k (so in the score), and the
// fast path must still give the reference's score: the key must not be
// taken (a bound of 10 would take it). At spread 9 keys are taken and agree.
func TestVNNISpreadBound(t *testing.T) {
	const hd = 128
	iq := make([]float32, 64*hd)
	for i := range iq {
		iq[i] = 15
	}
	w := make([]float32, 64)
	for i := range w {
		w[i] = 1
	}
	// blocks 0-2: random codes 12-15 shifted by 2^shift (their sum passes
	// 2^24 units), block 3: codes 1-15 unshifted, added one by one to that
	// sum (each add can round); each block's max is 15 (E = 3 before the
	// shift). The query: codes 12-15, the same for all heads (spread 0).
	rng := rand.New(rand.NewPCG(28, 29))
	codes := func(v []float32, lo, shift int) {
		for i := range v {
			v[i] = float32(math.Ldexp(float64(lo+rng.IntN(16-lo)), shift))
		}
		v[rng.IntN(len(v))] = float32(math.Ldexp(15, shift))
	}
	key := func(shift int) []float32 {
		k := make([]float32, hd)
		for b := 0; b < 3; b++ {
			codes(k[b*32:(b+1)*32], 12, shift)
		}
		codes(k[96:], 1, 0)
		return k
	}
	for b := 0; b < 4; b++ {
		codes(iq[b*32:(b+1)*32], 12, 0)
	}
	for h := 1; h < 64; h++ {
		copy(iq[h*hd:(h+1)*hd], iq[:hd])
	}
	spreadOf := func(k []float32) int {
		rec := make([]byte, vnniRecord)
		if !vnniPackRowRef(rec, k, 99) {
			return -1
		}
		return int(rec[vnniRecSpread])
	}
	var hazard []float32
	for try := 0; try < 1_000_000 && hazard == nil; try++ {
		k := key(10)
		var exact float64
		var ref float32
		for i := range k {
			exact += float64(iq[i]) * float64(k[i])
			ref += iq[i] * k[i]
		}
		if quant.BF16Round(ref) != quant.BF16Round(float32(exact)) { // (float32(exact): VCVTDQ2PS of T)
			hazard = k
		}
	}
	if hazard == nil || spreadOf(hazard) != 10 {
		t.Fatal("no spread-10 key whose fp32 rounding shows in bf16: the test needs another case")
	}
	safe := key(9)
	if s := spreadOf(safe); s != 9 {
		t.Fatalf("the spread-9 case has spread %d", s)
	}
	for _, c := range []struct {
		name  string
		k     []float32
		taken bool
	}{{"spread 10, rounds", hazard, false}, {"spread 9", safe, true}} {
		ic := append(append([]float32(nil), c.k...), c.k...) // two rows: a pair
		want := scoreRef(iq, ic, w, 64, hd)
		if HasVNNI() {
			q, ok := packVNNIQuery(iq, w)
			var recs [2 * vnniRecord]byte
			taken := ok && vnniPackRows(&recs[0], &ic[0], 2, vnniSpread-int(q.maxSq)) == 3
			if taken != c.taken {
				t.Errorf("%s: integer products taken %v, want %v", c.name, taken, c.taken)
			}
		}
		eachPath(t, func(t *testing.T) {
			got := make([]float32, 2)
			IndexScoresFast(got, iq, ic, w, 64, hd)
			sameBits(t, "score, "+c.name, got, want)
		})
	}
}

// IndexScoresKeys gives the reference's bits whatever its IndexKeys holds:
// kept across calls, grown, replaced by another cache of the same length
// (stale records), shortened; with keys of every kind mixed in.
func TestIndexScoresKeysEqualsReference(t *testing.T) {
	defer PoisonBufPools(PoisonBufPools(true)) // a pooled value read before it is written: NaN
	rng := rand.New(rand.NewPCG(26, 27))
	const hd = 128
	rows, _ := vnniRows(rng)
	mk := func(tc int) []float32 {
		ic := bf16Vec(rng, tc*hd, 1)
		quant.FQ4(ic, 32)
		for j := 0; j < tc; j += 5 { // every 5th key of another kind
			copy(ic[j*hd:(j+1)*hd], rows[rng.IntN(len(rows))])
		}
		return ic
	}
	iq, w := bf16Vec(rng, 64*hd, 1), bf16Vec(rng, 64, 0.1)
	quant.FQ4(iq, 32)
	ic := mk(600)
	other := mk(600)
	var keys IndexKeys
	eachPath(t, func(t *testing.T) {
		keys = IndexKeys{}
		for step, c := range []struct {
			name string
			ic   []float32
		}{{"first", ic[:300*hd]}, {"same", ic[:300*hd]}, {"grown", ic[:557*hd]}, {"grown by one", ic[:558*hd]},
			{"replaced", other[:558*hd]}, {"replaced again", ic[:558*hd]}, {"shorter", other[:100*hd]}, {"empty", ic[:0]}} {
			want := scoreRef(iq, c.ic, w, 64, hd)
			got := make([]float32, len(want))
			IndexScoresKeys(got, iq, c.ic, &keys, w, 64, hd)
			sameBits(t, fmt.Sprintf("step %d (%s)", step, c.name), got, want)
			nil2 := make([]float32, len(want))
			IndexScoresKeys(nil2, iq, c.ic, nil, w, 64, hd)
			sameBits(t, fmt.Sprintf("step %d (%s), no keys kept", step, c.name), nil2, want)
		}
	})
	// and the integer products did run on most keys
	if HasVNNI() {
		q, ok := packVNNIQuery(iq, w)
		if !ok {
			t.Fatal("query not packed")
		}
		recs := make([]byte, 600*vnniRecord)
		n := 0
		for j := 0; j < 600; j += 8 {
			n += popcount(vnniPackRows(&recs[j*vnniRecord], &ic[j*hd], min(8, 600-j), vnniSpread-int(q.maxSq)))
		}
		if n < 400 {
			t.Errorf("only %d of 600 keys taken by the integer products", n)
		}
	}
}

func popcount(x uint64) int {
	n := 0
	for ; x != 0; x &= x - 1 {
		n++
	}
	return n
}
