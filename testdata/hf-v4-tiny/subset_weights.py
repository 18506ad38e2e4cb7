"""Write the committed weight subset of the device run's bf16 checkpoint.

    python3 subset_weights.py CKPT_DIR OUT.safetensors

CKPT_DIR is the save_pretrained directory of the model as it ran (bf16, norms
cast to bf16; hf_ckpt_bf16/ of the run). Kept, byte for byte under their
save_pretrained names: every tensor of layers 0 and 1 except the FFN
(model.layers.{0,1}.attn.*, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*).
"""
import json
import os
import re
import struct
import sys

KEEP = re.compile(r"model\.layers\.[01]\.(?!ffn\.)")


def main(ck, out):
    idx = json.load(open(os.path.join(ck, "model.safetensors.index.json")))["weight_map"]
    tensors = {}
    for f in sorted(set(idx.values())):
        b = open(os.path.join(ck, f), "rb").read()
        (n,) = struct.unpack("<Q", b[:8])
        h = json.loads(b[8:8 + n])
        for k, v in h.items():
            if k != "__metadata__" and KEEP.match(k):
                s, e = v["data_offsets"]
                tensors[k] = (v["dtype"], v["shape"], b[8 + n + s: 8 + n + e])
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for k in sorted(tensors):
        dt, sh, data = tensors[k]
        hdr[k] = {"dtype": dt, "shape": sh, "data_offsets": [off, off + len(data)]}
        off += len(data)
    hb = json.dumps(hdr, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for k in sorted(tensors):
            f.write(tensors[k][2])
    print(len(tensors), "tensors", off, "bytes")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
