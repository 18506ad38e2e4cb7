// Package userfile is the one place where sparsemla touches a user's files:
// it opens what a command reads and writes what a command produces, so that
// no input can make a command hang, grow without bound or be harmed.
//
// Reading ([Open], [ReadFile], [CheckDir]): a path is checked to be a regular
// file (or a directory) before it is read; a FIFO, a device or a socket is
// refused at once with a message that says what it is (opening is done with
// O_NONBLOCK so that a FIFO swapped in after the check cannot block either);
// formats without a size limit of their own are read with a cap; an open
// error says what it is (permission denied, too many levels of symbolic
// links, too many open files), never "unrecognised file".
//
// Writing ([Guard]): a command first names its inputs; an output path that
// is, links to (symbolic or hard link: same device and inode) or lies inside
// one of them is refused. Outputs are written to a temporary file or
// directory beside the destination and renamed into place only when
// complete, so an error (a full disk) leaves nothing partial and the old
// file, if any, untouched. An output directory that exists must be empty or
// one this package made (it holds the [Marker] file listing its contents);
// an output file that exists is replaced only when it is the command's own
// output, as [OutputFile].Own recognises it, or with [OutputFile].Force
// (never a directory or an input): [Guard.WriteOutputFile].
//
// Messages ([Escape]): names and values from outside are printed with their
// control characters escaped, so a crafted file name cannot forge an output
// line or colour a terminal.
package userfile
