package userfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// MaxSmallFile is the default cap of ReadFile for the small text files
// sparsemla reads whole (tolerance files, name maps, config.json): far above
// any real one, far below what could hurt.
const MaxSmallFile = 4 << 20

// Error is an error about one user file: the path (escaped when printed),
// what is wrong, and the underlying error if any (errors.Is sees it).
type Error struct {
	Path   string
	Reason string
	Err    error
}

func (e *Error) Error() string { return Escape(e.Path) + ": " + e.Reason }
func (e *Error) Unwrap() error { return e.Err }

// ErrNotRegular is wrapped by the errors of Open, ReadFile and CheckDir for
// a path of the wrong type (FIFO, device, socket; a directory where a file
// is wanted or the reverse).
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is wrapped by ReadFile's error for a file over its cap.
var ErrTooLarge = errors.New("file too large")

// TypeName says what kind of file mode m is, for messages: "a regular file",
// "a directory", "a FIFO (named pipe)", "a character device", ...
func TypeName(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "a regular file"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO (named pipe)"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m&fs.ModeIrregular != 0:
		return "an irregular file"
	}
	return "a special file"
}

// Describe turns an error of the os package about path into an *Error whose
// reason says what happened in words (permission denied, no such file or
// directory, too many levels of symbolic links, too many open files, ...).
// Other errors are returned unchanged.
func Describe(path string, err error) error {
	if err == nil {
		return nil
	}
	var ue *Error
	if errors.As(err, &ue) {
		return err
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		if pe.Path != "" {
			path = pe.Path
		}
		return &Error{Path: path, Reason: reason(pe.Op, pe.Err), Err: err}
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return &Error{Path: path, Reason: reason(le.Op, le.Err), Err: err}
	}
	var se *os.SyscallError
	if errors.As(err, &se) {
		return &Error{Path: path, Reason: reason(se.Syscall, se.Err), Err: err}
	}
	return err
}

// reason words an errno the way the messages of sparsemla say it.
func reason(op string, err error) string {
	var what string
	switch {
	case errors.Is(err, syscall.EMFILE), errors.Is(err, syscall.ENFILE):
		what = "too many open files (raise the limit with ulimit -n)"
	case errors.Is(err, syscall.ELOOP):
		what = "too many levels of symbolic links"
	case errors.Is(err, fs.ErrPermission):
		what = "permission denied"
	case errors.Is(err, fs.ErrNotExist):
		what = "no such file or directory"
	case errors.Is(err, syscall.ENOSPC):
		what = "no space left on device"
	default:
		what = Escape(err.Error())
	}
	if op == "" || errors.Is(err, fs.ErrNotExist) {
		return what // "no such file or directory" says it all
	}
	return "cannot " + op + ": " + what
}

// describeAs is Describe naming path whatever path the error names (the
// temporary file an output is written to first means nothing to the user).
func describeAs(path string, err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return &Error{Path: path, Reason: reason(pe.Op, pe.Err), Err: err}
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return &Error{Path: path, Reason: reason(le.Op, le.Err), Err: err}
	}
	return Describe(path, err)
}

// Stat is os.Stat with its error described (Describe).
func Stat(path string) (fs.FileInfo, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, Describe(path, err)
	}
	return fi, nil
}

// CheckRegular returns fi when it is a regular file, else an error that
// says what path is.
func checkRegular(path string, fi fs.FileInfo) error {
	if fi.Mode().IsRegular() {
		return nil
	}
	return &Error{Path: path, Reason: "is " + TypeName(fi.Mode()) + ", not a regular file", Err: ErrNotRegular}
}

// CheckFile stats path and refuses anything but a regular file (following
// symbolic links).
func CheckFile(path string) (fs.FileInfo, error) {
	fi, err := Stat(path)
	if err != nil {
		return nil, err
	}
	if err := checkRegular(path, fi); err != nil {
		return nil, err
	}
	return fi, nil
}

// CheckDir stats path and refuses anything but a directory.
func CheckDir(path string) (fs.FileInfo, error) {
	fi, err := Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, &Error{Path: path, Reason: "is " + TypeName(fi.Mode()) + ", not a directory", Err: ErrNotRegular}
	}
	return fi, nil
}

// CheckFileOrDir stats path and refuses anything but a regular file or a
// directory.
func CheckFileOrDir(path string) (fs.FileInfo, error) {
	fi, err := Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() && !fi.Mode().IsRegular() {
		return nil, &Error{Path: path, Reason: "is " + TypeName(fi.Mode()) + ", not a regular file or a directory", Err: ErrNotRegular}
	}
	return fi, nil
}

// Open opens a regular file for reading. The path is checked before it is
// opened (a FIFO, device or socket is refused without opening it) and the
// opened file is checked again (it is opened non-blocking, so a FIFO put in
// its place meanwhile cannot block; it must be the file that was checked).
// The caller closes the file; fi is its FileInfo.
func Open(path string) (*os.File, fs.FileInfo, error) {
	fi, err := CheckFile(path)
	if err != nil {
		return nil, nil, err
	}
	f, err := os.OpenFile(path, os.O_RDONLY|openFlags, 0)
	if err != nil {
		return nil, nil, Describe(path, err)
	}
	fi2, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, Describe(path, err)
	}
	if err := checkRegular(path, fi2); err != nil {
		f.Close()
		return nil, nil, err
	}
	if !os.SameFile(fi, fi2) {
		f.Close()
		return nil, nil, &Error{Path: path, Reason: "changed while it was being opened"}
	}
	return f, fi2, nil
}

// ReadFile reads a whole regular file of at most max bytes (max <= 0:
// MaxSmallFile). A larger file is refused before anything is read; a file
// that grows while it is read is cut at max+1 bytes and refused.
func ReadFile(path string, max int64) ([]byte, error) {
	if max <= 0 {
		max = MaxSmallFile
	}
	f, fi, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() > max {
		return nil, &Error{Path: path, Reason: fmt.Sprintf("is %d bytes, larger than the %d-byte limit for this kind of file", fi.Size(), max), Err: ErrTooLarge}
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, Describe(path, err)
	}
	if int64(len(b)) > max {
		return nil, &Error{Path: path, Reason: fmt.Sprintf("grew past the %d-byte limit for this kind of file while it was read", max), Err: ErrTooLarge}
	}
	return b, nil
}
