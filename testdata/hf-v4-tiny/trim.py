"""Trim the device run's HF dumps to the committed fixtures, frame by frame.

    python3 trim.py SRC_DIR DST_DIR

Keeps the files step_none.smd (GPU RoPE tables), step_1.smd (the replay start
state after the 2-token prompt) and step_2..step_5.smd, and in them the frames
of layers 0 (sliding, r=0) and 1 (CSA, r=4) and the global records; every kept
frame is copied byte for byte (header included), the end frame is rewritten
with the new record count. Needs msgpack only.
"""
import os
import struct
import sys

import msgpack

KEEP_FILES = ["step_none.smd", "step_1.smd"] + ["step_%d.smd" % p for p in range(2, 6)]
KEEP_LAYERS = {-1, 0, 1}


def trim(src, dst):
    b = open(src, "rb").read()
    assert b[:8] == b"SPMLDUMP", src
    out, off, n = [b[:12]], 12, 0
    while off < len(b):
        (ml,) = struct.unpack_from("<I", b, off)
        meta = msgpack.unpackb(b[off + 4: off + 4 + ml], raw=False)
        end = off + 4 + ml + meta.get("nbytes", 0)
        frame = b[off:end]
        off = end
        t = meta.get("t")
        if t == "end":
            m = msgpack.packb({"t": "end", "records": n, "shape": []}, use_bin_type=True)
            out.append(struct.pack("<I", len(m)) + m)
        elif t == "tensor":
            if meta["layer"] in KEEP_LAYERS:
                out.append(frame)
                n += 1
        else:
            out.append(frame)
    open(dst, "wb").write(b"".join(out))
    return n


if __name__ == "__main__":
    s, d = sys.argv[1], sys.argv[2]
    os.makedirs(d, exist_ok=True)
    for f in KEEP_FILES:
        print(f, trim(os.path.join(s, f), os.path.join(d, f)))
