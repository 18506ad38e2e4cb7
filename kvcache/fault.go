package kvcache

import "fmt"

// FaultKind classifies a structural fault found while decoding a page.
type FaultKind uint8

const (
	// FaultScaleNaN: a UE8M0 scale byte 0xFF, or an fp32 scale that is NaN.
	FaultScaleNaN FaultKind = iota
	// FaultScaleRange: a scale no real block can produce (exponent outside
	// [FP8ScaleExpMin, FP8ScaleExpMax] or the FP4 bounds; an fp32 scale ≤ 0 or inf).
	FaultScaleRange
	// FaultScaleNotPow2: an fp32 scale (v32, indexer-fp8) with mantissa bits.
	FaultScaleNotPow2
	// FaultScaleLoose: the block's codes do not reach half the grid (|code| <
	// 224 for E4M3, < 3 for E2M1) under a scale above every engine's floored
	// range. Every encoder picks the smallest power of two s with amax/s ≤ qmax
	// (give or take one step at a power of two), so the codes of a real block
	// always reach qmax/2: such a block's codes were not written together with
	// its scale (codes zeroed, never written, or overwritten by another token's
	// while the scale stayed). A wrong scale over the right codes cannot be
	// seen from the page alone: compare decoded rows for that (VerifyPrefixHit).
	FaultScaleLoose
	// FaultCodeNaN: an E4M3 NaN code (0x7F/0xFF); the decoded value is NaN.
	FaultCodeNaN
	// FaultNonFinite: a bf16 value (rope half, or a bf16-layout value) that is
	// NaN or ±inf.
	FaultNonFinite
	// FaultPadNonZero: a pad byte that is not zero. Never read by a kernel, so
	// this is only reported (Severity Warn): writers that use torch.empty leave
	// garbage there.
	FaultPadNonZero
)

var faultNames = [...]string{
	FaultScaleNaN:     "scale-nan",
	FaultScaleRange:   "scale-out-of-range",
	FaultScaleNotPow2: "scale-not-power-of-two",
	FaultScaleLoose:   "scale-loose",
	FaultCodeNaN:      "fp8-nan-code",
	FaultNonFinite:    "non-finite",
	FaultPadNonZero:   "pad-nonzero",
}

func (k FaultKind) String() string {
	if int(k) < len(faultNames) {
		return faultNames[k]
	}
	return fmt.Sprintf("FaultKind(%d)", uint8(k))
}

// Severity says whether a fault makes the decoded entry untrustworthy.
type Severity uint8

const (
	Error Severity = iota // the entry's values are wrong or undefined
	Warn                  // reported only (pad bytes)
)

// Fault is one structural fault of a page: where it is and what is wrong.
// Faults of the same kind in the same scale block are reported once, at the
// first offending byte, with Count saying how many bytes of the block share it.
type Fault struct {
	Kind     FaultKind
	Severity Severity
	Entry    int      // entry within the page
	Offset   int      // byte offset within the page of the first offending byte
	Loc      Location // what that byte is
	Bits     uint32   // the offending byte / bf16 bits / fp32 bits
	Count    int      // offending bytes of this kind in the block (≥ 1)
	Detail   string   // a short human explanation
}

func (f Fault) String() string {
	sev := "error"
	if f.Severity == Warn {
		sev = "warning"
	}
	s := fmt.Sprintf("%s %v at page byte %d (%v), bits %#x", sev, f.Kind, f.Offset, f.Loc, f.Bits)
	if f.Count > 1 {
		s += fmt.Sprintf(", %d bytes in this block", f.Count)
	}
	if f.Detail != "" {
		s += ": " + f.Detail
	}
	return s
}

// Faults is a list of faults with a few helpers.
type Faults []Fault

// Errors counts the faults of Severity Error.
func (fs Faults) Errors() int {
	n := 0
	for _, f := range fs {
		if f.Severity == Error {
			n++
		}
	}
	return n
}

// FirstError returns the first fault of Severity Error, or nil.
func (fs Faults) FirstError() *Fault {
	for i := range fs {
		if fs[i].Severity == Error {
			return &fs[i]
		}
	}
	return nil
}
