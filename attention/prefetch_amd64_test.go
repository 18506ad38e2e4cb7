//go:build amd64 && !purego

package attention

import (
	"os"
	"strconv"
	"time"
)

// SPARSEMLA_FP8_PREFETCH=N sets the FP8 kernels' prefetch distance for a
// benchmark run (bytes; fp8Prefetch), to compare distances on one machine.
func init() {
	if v, err := strconv.Atoi(os.Getenv("SPARSEMLA_FP8_PREFETCH")); err == nil {
		fp8Prefetch = v
	}
}

// SPARSEMLA_POOL_SPIN_US=N sets how long idle pool workers spin (µs).
func init() {
	if v, err := strconv.Atoi(os.Getenv("SPARSEMLA_POOL_SPIN_US")); err == nil {
		SetPoolSpin(time.Duration(v) * time.Microsecond)
	}
}

// SPARSEMLA_AVX512=0 keeps the index scoring and the FP8 kernels on their AVX2
// forms (UseAVX512).
func init() {
	if os.Getenv("SPARSEMLA_AVX512") == "0" {
		UseAVX512 = false
	}
}

// SPARSEMLA_VBMI=0 keeps the AVX-512 FP8 kernels' rows with a subnormal code
// on DEC64Z (fp8VBMI), to compare it with DEC64V on one machine.
func init() {
	if os.Getenv("SPARSEMLA_VBMI") == "0" {
		fp8VBMI = 0
	}
}

// SPARSEMLA_VNNI=0 keeps every index key on the fp32 kernel (UseVNNI).
func init() {
	if os.Getenv("SPARSEMLA_VNNI") == "0" {
		UseVNNI = false
	}
}

// SPARSEMLA_VNNI_PREFETCH=N sets vnniVerifyRows's prefetch distance (bytes).
func init() {
	if v, err := strconv.Atoi(os.Getenv("SPARSEMLA_VNNI_PREFETCH")); err == nil {
		vnniPrefetch = v
	}
}
