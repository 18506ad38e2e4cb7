package dump

import (
	"archive/zip"
	"os"
	"strings"
)

// zipFormat tells a torch.save zip ("pt") from an .npz ("npz"); any other
// zip is "unknown" (an error: it must not read as an empty dump).
func zipFormat(f *os.File) string {
	fi, err := f.Stat()
	if err != nil {
		return "unknown"
	}
	zr, err := zip.NewReader(f, fi.Size())
	if err != nil {
		if strings.HasSuffix(strings.ToLower(f.Name()), ".npz") {
			return "npz" // let the npz reader report the damage
		}
		return "unknown"
	}
	if isTorchZip(zr) {
		return "pt"
	}
	for _, m := range zr.File {
		if strings.HasSuffix(m.Name, ".npy") {
			return "npz"
		}
	}
	if len(zr.File) == 0 && strings.HasSuffix(strings.ToLower(f.Name()), ".npz") {
		return "npz"
	}
	return "unknown"
}
