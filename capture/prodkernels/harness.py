#!/usr/bin/env python3
"""Run production DeepSeek-V4 kernels (vLLM / SGLang Triton, FlashMLA) on the golden's dumped inputs.

The kernel files themselves are NOT part of this repository: copy them, unmodified, into a folder
(default .kern/) as testdata/kernels/README.md says, then on a GPU host:

    python3 capture/prodkernels/harness.py run --src .kern --out OUTDIR \
        testdata/official-v4-tiny testdata/gpu-v4-tiny-long

FlashMLA (sm90 sparse FP8 decode): `flashmla-build` builds its sparse decode path from FlashMLA's
csrc/ and CUTLASS's headers; `flashmla-synth` runs it on prodkernel's synthetic input; `run --only
flashmla --flashmla-in DIR` on the goldens' pages (testdata/kernels/README.md has the commands).

Indexer scores and top-k: `run --only paged_mqa --tag index --vllm-topk BUILD` runs SGLang's and
vLLM's torch scorers, SGLang's torch top-k and (built from vLLM's sampler.cu into BUILD) vLLM's CUDA
top_k_per_row_decode on the goldens; `index-synth` on synthetic units at V4-Flash dims.
`ptopk --csrc VLLM --module BUILD --out OUT DIR...` builds vLLM's persistent_topk (topk.cu) and runs
it at k = 512 on the vllm_logits stored in testdata/kernels/DIR (and on PTOPK_EXTRA).

It writes OUTDIR/<dump name>/kernels-TAG.safetensors (every kernel output, named below) and
OUTDIR/<dump name>/kernels-TAG.json (what ran: kernels, source commits, shapes, versions, errors).
Each kernel runs in its own try/except: one that fails is recorded with its error and the others
go on.

`selftest` checks the torch-free parts (safetensors reader/writer, slot and page geometry) and runs
without torch or a GPU.

Only imports the kernel files do not need for the calls made here are stubbed (vllm.platforms,
vllm.triton_utils, ...); every stub is written by `write_stubs` below and listed in kernels.json.
"""

import json
import os
import struct
import sys
import time
import traceback

# ---------------------------------------------------------------- geometry (torch-free)

WINDOW = 128
PAGE_ENTRIES = 64  # vLLM SWA block size; SGLang page size used here
MODEL1_DATA = 576  # 448 E4M3 + 64 bf16
MODEL1_SCALE = 8  # 7 UE8M0 + 1 pad
MODEL1_PAGE_BYTES = (PAGE_ENTRIES * (MODEL1_DATA + MODEL1_SCALE) + MODEL1_DATA - 1) // MODEL1_DATA * MODEL1_DATA


def live_rows(p, rows):
    """Cache rows holding data after step p: window slots of tokens 0..p, then every compressed row."""
    out = [s for s in range(min(WINDOW, rows)) if s <= p]
    out += list(range(WINDOW, rows))
    return out


def block_table(rows):
    """Logical block b -> physical page nb - b (page 0 is never used, so a page id of 0 is a bug)."""
    nb = (rows + PAGE_ENTRIES - 1) // PAGE_ENTRIES
    return [nb - b for b in range(nb)], nb + 1


def slot_of(row, table):
    return table[row // PAGE_ENTRIES] * PAGE_ENTRIES + row % PAGE_ENTRIES


def entry_bytes(page, pos):
    """The 584 bytes of entry pos of a MODEL1 page: data row then its 8 scale bytes."""
    d = page[pos * MODEL1_DATA:(pos + 1) * MODEL1_DATA]
    s0 = PAGE_ENTRIES * MODEL1_DATA + pos * MODEL1_SCALE
    return bytes(d) + bytes(page[s0:s0 + MODEL1_SCALE])


# ---------------------------------------------------------------- safetensors (torch-free)

ST_SIZES = {"F32": 4, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "F8_E4M3": 1}


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > 1 << 26:
            raise ValueError(f"{path}: header of {n} bytes")
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = (v["dtype"], list(v["shape"]), data[a:b])
    return out


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> (dtype, shape, raw bytes), written in name order."""
    hdr, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, shape, raw = tensors[k]
        want = ST_SIZES[dt]
        for s in shape:
            want *= s
        if len(raw) != want:
            raise ValueError(f"{k}: {len(raw)} bytes for {dt}{shape}")
        hdr[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    if metadata:
        hdr["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def golden_steps(d):
    steps = []
    for n in os.listdir(d):
        if n.startswith("step_") and n.endswith(".safetensors"):
            steps.append(int(n[5:-12]))
    return sorted(steps)


def selftest():
    import tempfile
    assert MODEL1_PAGE_BYTES == 37440, MODEL1_PAGE_BYTES
    assert live_rows(3, 130)[:5] == [0, 1, 2, 3, 128] and len(live_rows(200, 130)) == 130
    t, n = block_table(130)
    assert t == [3, 2, 1] and n == 4
    assert slot_of(129, t) == 1 * 64 + 1 and slot_of(5, t) == 3 * 64 + 5
    page = bytearray(MODEL1_PAGE_BYTES)
    page[2 * 576] = 7
    page[64 * 576 + 2 * 8 + 6] = 9
    e = entry_bytes(page, 2)
    assert len(e) == 584 and e[0] == 7 and e[576 + 6] == 9
    with tempfile.TemporaryDirectory() as td:
        p = os.path.join(td, "x.safetensors")
        write_safetensors(p, {"b": ("U8", [3], b"abc"), "a": ("F32", [1], struct.pack("<f", 1.5))}, {"k": 1})
        r = read_safetensors(p)
        assert r["b"] == ("U8", [3], b"abc") and struct.unpack("<f", r["a"][2])[0] == 1.5
    here = os.path.dirname(os.path.abspath(__file__))
    g = os.path.join(here, "..", "..", "testdata", "official-v4-tiny")
    if os.path.isdir(g):
        assert golden_steps(g) == [2, 3, 4, 5, 6, 7]
        st = read_safetensors(os.path.join(g, "step_7.safetensors"))
        assert st["L1.kv_cache"][1] == [130, 512] and st["L1.cmp_roped"][0] == "BF16"
    print("selftest ok")


# ---------------------------------------------------------------- stubs for imports the kernels do not need

STUBS = {
    "vllm/__init__.py": "",
    "vllm/triton_utils.py": "import triton\nimport triton.language as tl\n",
    "vllm/platforms.py": (
        "class _P:\n"
        "    def is_rocm(self): return False\n"
        "    def is_xpu(self): return False\n"
        "    def is_cuda(self): return True\n"
        "    def fp8_dtype(self):\n"
        "        import torch\n"
        "        return torch.float8_e4m3fn\n"
        "current_platform = _P()\n"),
    "vllm/utils/math_utils.py": "def cdiv(a, b):\n    return -(a // -b)\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/import_utils.py": "def has_cutedsl():\n    return False\n",
    # DeepGEMM's rule: round x up to a multiple of 16 bytes' worth of elements.
    "vllm/utils/deep_gemm.py": (
        "def get_tma_aligned_size(x, element_size):\n"
        "    a = 16 // element_size\n"
        "    return (x + a - 1) // a * a\n"),
    # A real registration (torch.library), so the public wrapper runs as in vLLM.
    "vllm/utils/torch_utils.py": (
        "import torch\n"
        "_lib = torch.library.Library('vllm', 'FRAGMENT')\n"
        "def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None,\n"
        "                              target_lib=None, dispatch_key='CUDA', tags=()):\n"
        "    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or ())\n"
        "    _lib.define(op_name + schema)\n"
        "    _lib.impl(op_name, op_func, dispatch_key)\n"
        "    if fake_impl is not None:\n"
        "        _lib._register_fake(op_name, fake_impl)\n"),
    "vllm/models/__init__.py": "",
    "vllm/models/deepseek_v4/__init__.py": "",
    "vllm/models/deepseek_v4/common/__init__.py": "",
    "vllm/models/deepseek_v4/common/ops/__init__.py": "",
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils.py": "import torch\ndef get_fp8_e4m3_dtype():\n    return torch.float8_e4m3fn\n",
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/layers/quantization/__init__.py": "",
    "sglang/srt/layers/quantization/fp8_kernel.py": "def is_fp8_fnuz():\n    return False\n",
    "sglang/srt/layers/attention/__init__.py": "",
    "sglang/srt/layers/attention/dsv4/__init__.py": "",
    # Only the plan types the HIP compressor file imports; the pooling kernel run here uses neither.
    "sglang/jit_kernel/__init__.py": "",
    "sglang/jit_kernel/dsv4/__init__.py": "",
    "sglang/jit_kernel/dsv4/compress_old.py": "class CompressorDecodePlan:\n    pass\nclass CompressorPrefillPlan:\n    pass\n",
}

KERNEL_FILES = {
    "vllm_src/cache_utils.py": "vllm/models/deepseek_v4/common/ops/cache_utils.py",
    "vllm_src/fused_indexer_q.py": "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py",
    "vllm_src/fused_inv_rope_fp8_quant.py": "vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py",
    "sglang_src/quant_k_cache.py": "sglang/srt/layers/attention/dsv4/quant_k_cache.py",
    "sglang_src/index_buf_accessor.py": "sglang/srt/layers/attention/dsv4/index_buf_accessor.py",
    "vllm_src/fused_compress_quant_cache.py": "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py",
    "sglang_src/fused_compress_triton.py": "sglang/srt/layers/attention/dsv4/fused_compress_triton.py",
    # Indexer scores and top-k: only named functions are taken from these two (extract_functions).
    "sglang_src/indexer.py": "sglang/srt/layers/attention/dsv4/indexer.py",
    "vllm_src/rocm_aiter_mla_sparse.py": "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",
}


def write_stubs(src, root):
    import hashlib
    files = {}
    for rel, text in STUBS.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    for s, rel in KERNEL_FILES.items():
        sp = os.path.join(src, s)
        if not os.path.isfile(sp):
            files[rel] = "missing"
            continue
        raw = open(sp, "rb").read()
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(raw)
        files[rel] = hashlib.sha256(raw).hexdigest()
    sys.path.insert(0, root)
    return files


# ---------------------------------------------------------------- the runs (torch from here on)

def run(args):
    import torch
    src, out_root, dirs = args.src, args.out, args.dirs
    root = os.path.join(out_root, "_pkg")
    hashes = write_stubs(src, root)
    sources = {}
    sp = os.path.join(src, "SOURCES.json")
    if os.path.isfile(sp):
        sources = json.load(open(sp))
    import triton
    env = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    print("env", env, flush=True)
    for d in dirs:
        name = os.path.basename(os.path.normpath(d))
        od = os.path.join(out_root, name)
        os.makedirs(od, exist_ok=True)
        res = {"dump": name, "env": env, "sources": sources, "kernel_file_sha256": hashes,
               "stubs": sorted(STUBS), "runs": {}}
        outs = {}
        g = Golden(d, torch)
        todo = [("vllm_quantize_and_insert_k_cache", run_vllm_k),
                          ("sglang_quant_k_cache_set_k_and_s", run_sglang_k),
                          ("vllm_fused_inv_rope_fp8_quant", run_vllm_inv_rope),
                          ("vllm_fused_indexer_q_rope_quant_fp8", lambda g, o, t: run_vllm_indexer_q(g, o, t, False)),
                          ("vllm_fused_indexer_q_rope_quant_mxfp4", lambda g, o, t: run_vllm_indexer_q(g, o, t, True)),
                          ("vllm_fused_compress_quant_cache", lambda g, o, t: run_vllm_compress(g, o, t, "main", False)),
                          ("vllm_fused_compress_quant_cache_indexer_fp8", lambda g, o, t: run_vllm_compress(g, o, t, "indexer", False)),
                          ("vllm_fused_compress_quant_cache_indexer_mxfp4", lambda g, o, t: run_vllm_compress(g, o, t, "indexer", True)),
                          ("sglang_compressor_fused_ape_pool_norm_rope", lambda g, o, t: run_sglang_pool(g, o, t, "main")),
                          ("sglang_compressor_fused_ape_pool_norm_rope_indexer", lambda g, o, t: run_sglang_pool(g, o, t, "indexer")),
                          ("sglang_compressor_fused_ape_pool_norm_rope_repeat", lambda g, o, t: run_sglang_pool(g, o, t, "main", args.repeat)),
                          ("sglang_fp8_paged_mqa_logits_torch", lambda g, o, t: run_index_score(g, o, t, src, args.vllm_topk)),
                          ("flashmla_sparse_decode_fwd", lambda g, o, t: run_flashmla(g, o, t, args.flashmla_in, name))]
        todo = [(k, f) for k, f in todo if (not args.only or args.only in k) and (not args.skip or args.skip not in k)]
        for kname, fn in todo:
            t0 = time.time()
            try:
                info = fn(g, outs, torch)
                res["runs"][kname] = {"ok": True, "seconds": round(time.time() - t0, 2), **(info or {})}
                print(f"[{name}] {kname}: ok ({time.time() - t0:.1f}s)", flush=True)
            except Exception as e:  # each kernel on its own: record and go on
                res["runs"][kname] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()[-4000:]}
                print(f"[{name}] {kname}: FAILED {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
        write_safetensors(os.path.join(od, f"kernels-{args.tag}.safetensors"), outs, {"producer": "capture/prodkernels/harness.py"})
        with open(os.path.join(od, f"kernels-{args.tag}.json"), "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)


def tbytes(t):
    """(dtype, shape, raw) of a CPU copy of a tensor."""
    import torch
    # A fresh tensor has standard strides even where a size-1 dim let a view count as contiguous.
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    dt = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
          torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}[t.dtype]
    return (dt, list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def to_cuda(torch, e):
    """A (dtype, shape, raw) entry as a CUDA tensor."""
    dt, shape, raw = e
    tdt = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}[dt]
    if not raw:
        return torch.empty(shape, dtype=tdt, device="cuda")
    return torch.frombuffer(bytearray(raw), dtype=tdt).reshape(shape).cuda()


class Golden:
    """The golden dump's tensors on the GPU: g.t(step, 'L1.kv') etc."""

    def __init__(self, d, torch):
        self.d, self.torch = d, torch
        self.cfg = json.load(open(os.path.join(d, "config.json")))
        self.files = {p: read_safetensors(os.path.join(d, f"step_{p}.safetensors")) for p in golden_steps(d)}
        # Decode steps with stage tensors (a state-only file, e.g. step_254 of gpu-v4-tiny-long, has none).
        self.steps = [p for p in sorted(self.files) if "L0.kv_roped" in self.files[p]]
        self.rope = read_safetensors(os.path.join(d, "rope_tables.safetensors"))
        self.weights = read_safetensors(os.path.join(d, "weights.safetensors"))

    def conv(self, e):
        return to_cuda(self.torch, e)

    def has(self, p, k):
        return k in self.files[p]

    def t(self, p, k):
        return self.conv(self.files[p][k])

    def ratio(self, l):
        return self.cfg["compress_ratios"][l]

    def cos_sin(self, l):
        """[max_pos, 64] fp32 cos(32) || sin(32), from the GPU's own freqs_cis table of the layer."""
        fc = self.conv(self.rope["freqs_cis_r0" if self.ratio(l) == 0 else "freqs_cis_cmp"])
        return self.torch.cat([fc[:, :, 0], fc[:, :, 1]], dim=1).contiguous()


def k_rows(g, p, l):
    """Rows a window-K writer is given at step p: the live rows of the dumped kv_cache (already on the
    FQ8 grid, re-encoded), except the rows written at this step, which come from their pre-quantisation
    values (kv_roped -> slot p mod 128; cmp_roped -> row 128 + p div r)."""
    kv = g.t(p, f"L{l}.kv_cache").clone()
    written = [p % WINDOW]
    kv[p % WINDOW] = g.t(p, f"L{l}.kv_roped")
    if g.ratio(l) and g.has(p, f"L{l}.cmp_roped"):
        j = WINDOW + p // g.ratio(l)
        kv[j] = g.t(p, f"L{l}.cmp_roped")
        written.append(j)
    return kv, live_rows(p, kv.shape[0]), written


def run_window_k(g, outs, torch, prefix, write):
    last = g.steps[-1]
    n = 0
    for p in g.steps:
        for l in range(g.cfg["n_layers"]):
            kv, live, written = k_rows(g, p, l)
            table, nphys = block_table(kv.shape[0])
            cache = torch.zeros((nphys, MODEL1_PAGE_BYTES), dtype=torch.uint8, device="cuda")
            slots = torch.tensor([slot_of(r, table) for r in live], dtype=torch.int64, device="cuda")
            write(kv[live].contiguous(), cache, slots)
            torch.cuda.synchronize()
            host = cache.cpu()
            ent = []
            for r in written:
                ent.append(entry_bytes(host[table[r // PAGE_ENTRIES]].numpy().tobytes(), r % PAGE_ENTRIES))
            outs[f"{prefix}.p{p}.L{l}.entries"] = ("U8", [len(ent), 584], b"".join(ent))
            outs[f"{prefix}.p{p}.L{l}.rows"] = ("I64", [len(written)], struct.pack(f"<{len(written)}q", *written))
            if p == last:
                outs[f"{prefix}.p{p}.L{l}.pages"] = tbytes(host)
                outs[f"{prefix}.p{p}.L{l}.block_table"] = ("I64", [len(table)], struct.pack(f"<{len(table)}q", *table))
            n += 1
    return {"units": n, "page_entries": PAGE_ENTRIES, "page_bytes": MODEL1_PAGE_BYTES, "pages_at_step": last}


def run_vllm_k(g, outs, torch):
    from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

    def write(k, cache, slots):
        quantize_and_insert_k_cache(k, cache, slots, block_size=PAGE_ENTRIES)
    return run_window_k(g, outs, torch, "vllm_k", write)


def run_sglang_k(g, outs, torch):
    from sglang.srt.layers.attention.dsv4.quant_k_cache import quant_to_nope_fp8_rope_bf16_pack_triton
    from sglang.srt.layers.attention.dsv4.index_buf_accessor import _set_k_and_s_triton

    def write(k, cache, slots):
        pack = quant_to_nope_fp8_rope_bf16_pack_triton(k)
        _set_k_and_s_triton(cache, slots, pack, PAGE_ENTRIES)
    return run_window_k(g, outs, torch, "sglang_k", write)


def run_vllm_inv_rope(g, outs, torch):
    from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant
    G = g.cfg["o_groups"]
    H = g.cfg["n_heads"]
    for l in range(g.cfg["n_layers"]):
        o = torch.stack([g.t(p, f"L{l}.o") for p in g.steps])  # [T, H, 512] bf16
        pos = torch.tensor(g.steps, dtype=torch.int64, device="cuda")
        q8, sc = fused_inv_rope_fp8_quant(o, pos, g.cos_sin(l), G, H // G)
        torch.cuda.synchronize()
        outs[f"vllm_oinv.L{l}.fp8"] = tbytes(q8.contiguous().view(torch.uint8))  # [T, G, (H/G)*512] E4M3 codes
        outs[f"vllm_oinv.L{l}.scale"] = tbytes(sc.contiguous())  # [T, G, (H/G)*512/128] fp32
        outs[f"vllm_oinv.L{l}.steps"] = tbytes(pos)
    return {"n_groups": G, "heads_per_group": H // G, "quant_group_size": 128, "tma_aligned_scales": False}


def run_vllm_indexer_q(g, outs, torch, fp4):
    from vllm.models.deepseek_v4.common.ops.fused_indexer_q import fused_indexer_q_rope_quant
    HI = g.cfg["index_n_heads"]
    D = g.cfg["index_head_dim"]
    tag = "vllm_iq4" if fp4 else "vllm_iq8"
    layers = [l for l in range(g.cfg["n_layers"]) if g.ratio(l) == 4]
    for l in layers:
        q = torch.stack([g.t(p, f"L{l}.iq_b") for p in g.steps])  # [T, HI, 128] bf16
        w = torch.stack([g.t(p, f"L{l}.iw_raw") for p in g.steps])  # [T, HI] bf16
        pos = torch.tensor(g.steps, dtype=torch.int64, device="cuda")
        qq, wo = fused_indexer_q_rope_quant(pos, q, g.cos_sin(l), w, D ** -0.5, HI ** -0.5, use_fp4=fp4)
        torch.cuda.synchronize()
        if fp4:
            vals, scales = qq
            outs[f"{tag}.L{l}.packed"] = tbytes(vals)  # [T, HI, 64] u8, low nibble = even index
            outs[f"{tag}.L{l}.scale"] = tbytes(scales.contiguous().view(torch.uint8).reshape(len(g.steps), HI, D // 32))
        else:
            outs[f"{tag}.L{l}.fp8"] = tbytes(qq.view(torch.uint8))  # [T, HI, 128] E4M3 codes
        outs[f"{tag}.L{l}.weights"] = tbytes(wo)  # [T, HI] fp32
        outs[f"{tag}.L{l}.steps"] = tbytes(pos)
    return {"layers": layers, "softmax_scale": D ** -0.5, "head_scale": HI ** -0.5}


# ---------------------------------------------------------------- indexer scores and top-k

def extract_functions(path, names, ns):
    """Compile only the named top-level functions of a kernel file, their text unmodified, into ns.
    The two files these come from import half of their engine at module level (model configs,
    server args, DeepGEMM, aiter); the functions themselves use torch and the names put in ns.
    Returns {name: SHA-256 of the function's source text}."""
    import ast
    import hashlib
    text = open(path).read()
    tree = ast.parse(text)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            seg = ast.get_source_segment(text, node)
            found[node.name] = hashlib.sha256(seg.encode()).hexdigest()
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), ns)
    missing = [n for n in names if n not in found]
    if missing:
        raise KeyError(f"{path}: no function {missing}")
    return found


def pow2_scale(torch, x):
    """Per-row power-of-two scale 2^ceil(log2(amax/448)) (1 for an all-zero row)."""
    amax = x.abs().amax(dim=-1)
    s = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / 448.0)))
    return torch.where(amax > 0, s, torch.ones_like(s))


def index_unit(g, torch, p, l):
    """The scoring kernels' inputs for step p, layer l, re-encoded from the golden's own tensors: the
    reference's q (iq: Had + FQ4, bf16) and index keys (icache rows < Tc, the same grid) as E4M3 codes
    with one power-of-two scale per head / per row, which holds them exactly (checked, `exact`), the
    q scale folded into the head weights (iw, fp32) as both engines do; the keys in 64-row pages of
    132-byte entries (SGLang's / DeepGEMM's layout: 64 x 128 codes, then 64 fp32 scales), logical
    block b in page nb - b (page 0 unused)."""
    tc = g.files[p][f"L{l}.index_score"][1][0]
    return make_index_unit(torch, g.t(p, f"L{l}.iq").float(), g.t(p, f"L{l}.icache")[:tc].float(),
                           g.t(p, f"L{l}.iw").float())


def make_index_unit(torch, q, k, w):
    """index_unit's encoding of q [H, 128], keys k [Tc, 128] and head weights w [H] (fp32 tensors)."""
    f8 = torch.float8_e4m3fn
    tc = k.shape[0]
    sk, sq = pow2_scale(torch, k), pow2_scale(torch, q)
    kq, qq = (k / sk[:, None]).to(f8), (q / sq[:, None]).to(f8)
    exact = bool((kq.float() * sk[:, None] == k).all() and (qq.float() * sq[:, None] == q).all())
    nb = (tc + PAGE_ENTRIES - 1) // PAGE_ENTRIES
    ent = 128 + 4
    cache = torch.zeros(nb + 1, PAGE_ENTRIES * ent, dtype=torch.uint8, device="cuda")
    kb, sb = kq.view(torch.uint8), sk.contiguous().view(torch.uint8).reshape(tc, 4)
    for j in range(tc):
        pg, o = nb - j // PAGE_ENTRIES, j % PAGE_ENTRIES
        cache[pg, o * 128:(o + 1) * 128] = kb[j]
        cache[pg, PAGE_ENTRIES * 128 + o * 4:PAGE_ENTRIES * 128 + (o + 1) * 4] = sb[j]
    table = torch.tensor([[nb - b for b in range(nb)]], dtype=torch.int32, device="cuda")
    return {"tc": tc, "nb": nb, "exact": exact, "q": qq, "sq": sq, "k": kq, "sk": sk, "w": w * sq,
            "cache": cache.view(nb + 1, PAGE_ENTRIES, 1, ent), "table": table}


# Our binding of vLLM's top_k_per_row_decode (csrc/libtorch_stable/sampler.cu, compiled unmodified):
# the schema line of vLLM's torch_bindings.cpp, registered under a namespace of our own.
VLLM_TOPK_FILES = ["csrc/cuda_compat.h", "csrc/libtorch_stable/sampler.cu", "csrc/libtorch_stable/dispatch_utils.h",
                   "csrc/libtorch_stable/torch_utils.h"]
VLLM_TOPK_BINDING = r'''
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
void top_k_per_row_decode(const torch::stable::Tensor& logits, int64_t next_n,
                          const torch::stable::Tensor& seqLens,
                          torch::stable::Tensor& indices, int64_t numRows,
                          int64_t stride0, int64_t stride1, int64_t topK);
STABLE_TORCH_LIBRARY(sparsemla_vllm, ops) {
  ops.def("top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor! indices, "
          "int numRows, int stride0, int stride1, int topK) -> ()");
}
STABLE_TORCH_LIBRARY_IMPL(sparsemla_vllm, CUDA, ops) {
  ops.impl("top_k_per_row_decode", TORCH_BOX(&top_k_per_row_decode));
}
'''


_VTOPK_LOADED = set()


def vllm_topk_load(csrc, out):
    """Build vLLM's sampler.cu (its top-k kernels) with our binding: torch's JIT extension builder,
    sm_90a, the defines vLLM's CMakeLists gives _C_stable_libtorch (USE_CUDA, TORCH_TARGET_VERSION
    2.11). Loads the library; the op is torch.ops.sparsemla_vllm.top_k_per_row_decode."""
    import torch
    from torch.utils import cpp_extension
    if out in _VTOPK_LOADED:
        return torch.ops.sparsemla_vllm.top_k_per_row_decode
    os.makedirs(out, exist_ok=True)
    b = os.path.join(out, "vllm_topk_binding.cpp")
    with open(b, "w") as f:
        f.write(VLLM_TOPK_BINDING)
    defs = ["-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL"]
    cpp_extension.load(name="sparsemla_vllm_topk", sources=[b, os.path.join(csrc, "csrc/libtorch_stable/sampler.cu")],
                       extra_cflags=["-O3", "-std=c++17"] + defs,
                       extra_cuda_cflags=["-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a"] + defs,
                       extra_include_paths=[os.path.join(csrc, "csrc/libtorch_stable")],
                       build_directory=out, is_python_module=False, verbose=False)
    _VTOPK_LOADED.add(out)
    return torch.ops.sparsemla_vllm.top_k_per_row_decode


# Our binding of vLLM's persistent_topk (csrc/libtorch_stable/topk.cu + persistent_topk.cuh, compiled
# unmodified): the schema line of vLLM's torch_bindings.cpp, under a namespace of our own.
VLLM_PTOPK_FILES = ["csrc/libtorch_stable/topk.cu", "csrc/libtorch_stable/persistent_topk.cuh",
                    "csrc/libtorch_stable/torch_utils.h"]
VLLM_PTOPK_BINDING = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
void persistent_topk(const torch::stable::Tensor& logits,
                     const torch::stable::Tensor& lengths,
                     torch::stable::Tensor& output,
                     torch::stable::Tensor& workspace, int64_t k,
                     int64_t max_seq_len);
STABLE_TORCH_LIBRARY(sparsemla_vllm_pt, ops) {
  ops.def("persistent_topk(Tensor logits, Tensor lengths, Tensor! output, "
          "Tensor workspace, int k, int max_seq_len) -> ()");
}
STABLE_TORCH_LIBRARY_IMPL(sparsemla_vllm_pt, CUDA, ops) {
  ops.impl("persistent_topk", TORCH_BOX(&persistent_topk));
}
"""

# vLLM's RADIX_TOPK_WORKSPACE_SIZE (vllm/model_executor/layers/sparse_attn_indexer.py).
VLLM_PTOPK_WORKSPACE = 1024 * 1024


def vllm_ptopk_load(csrc, out):
    """Build vLLM's topk.cu (persistent_topk, its header persistent_topk.cuh, cub) with our binding, as
    vllm_topk_load builds sampler.cu (same flags and defines). The op is
    torch.ops.sparsemla_vllm_pt.persistent_topk."""
    import torch
    from torch.utils import cpp_extension
    os.makedirs(out, exist_ok=True)
    b = os.path.join(out, "vllm_ptopk_binding.cpp")
    with open(b, "w") as f:
        f.write(VLLM_PTOPK_BINDING)
    defs = ["-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL"]
    cpp_extension.load(name="sparsemla_vllm_ptopk", sources=[b, os.path.join(csrc, "csrc/libtorch_stable/topk.cu")],
                       extra_cflags=["-O3", "-std=c++17"] + defs,
                       extra_cuda_cflags=["-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a"] + defs,
                       extra_include_paths=[os.path.join(csrc, "csrc/libtorch_stable")],
                       build_directory=out, is_python_module=False, verbose=False)
    return torch.ops.sparsemla_vllm_pt.persistent_topk


# Extra logits-only units for persistent_topk's other paths (V4-Flash k = 512): name, rows, Tc of row 0,
# Tc step per row, width (the row stride, vLLM's max_model_len), seed, quantum (0: randn as drawn; q:
# rounded to multiples of q, many exact ties). Tc <= 8192: histogram_2048_topk; <= 32768:
# histogram_256_topk; above: the multi-CTA radix_topk; more than 32 rows: FilteredTopK.
PTOPK_EXTRA = [("x0", 1, 12000, 0, 16384, 11, 0), ("x1", 1, 40000, 0, 65536, 12, 0),
               ("x2", 1, 5000, 0, 8192, 13, 0.25), ("x3", 33, 600, 97, 4096, 14, 0)]


def ptopk_run(args):
    """vLLM's persistent_topk (k = 512) on the logits vLLM's scorer gave in the captured index runs
    (DIR/kernels-index{,-synth}.safetensors: every <unit>.vllm_logits, fed at the width it was
    computed at, one row, lengths = Tc, max_seq_len = Tc, a 1 MiB workspace as vLLM's) and on
    PTOPK_EXTRA; OUT/<dir name>/kernels-ptopk.{safetensors,json}: <unit>.vllm_ptopk512 (int32 [512]),
    and for the extra units ptopk.<name>.r<i>.logits too."""
    import torch
    import hashlib
    t0 = time.time()
    info = {"errors": {}, "env": {"torch": torch.__version__, "cuda": torch.version.cuda,
                                  "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}}
    try:
        op = vllm_ptopk_load(args.csrc, args.module)
    except Exception as e:
        info["errors"]["build"] = f"{type(e).__name__}: {e}"[-6000:]
        op = None
    info["build_s"] = round(time.time() - t0, 1)
    info["vllm_csrc_sha256"] = {rel: hashlib.sha256(open(os.path.join(args.csrc, rel), "rb").read()).hexdigest()
                                for rel in VLLM_PTOPK_FILES}
    ws = torch.zeros(VLLM_PTOPK_WORKSPACE, dtype=torch.uint8, device="cuda")

    def call(lg, tcs):
        lens = torch.tensor(tcs, dtype=torch.int32, device="cuda")[:, None]  # (B, 1), as vLLM's seq_lens
        out = torch.full((lg.shape[0], 512), -7, dtype=torch.int32, device="cuda")
        op(lg, lens, out, ws, 512, max(tcs))
        torch.cuda.synchronize()
        return out

    for d in args.dirs:
        name = os.path.basename(os.path.normpath(d))
        synth = os.path.exists(os.path.join(d, "kernels-index-synth.safetensors"))
        tag = "index-synth" if synth else "index"
        src = read_safetensors(os.path.join(d, f"kernels-{tag}.safetensors"))
        js = json.load(open(os.path.join(d, f"kernels-{tag}.json")))
        tcs = {}
        if synth:
            width = 16384  # index_synth's vLLM width
            for u in js["units"]:
                tcs[f"isynth.{u['case']}."] = u["tc"]
        else:
            width = 0
            r = js["runs"]["sglang_fp8_paged_mqa_logits_torch"]
            for u in r["units"]:
                tcs[f"iscore.p{u['step']}.L{u['layer']}."] = u["tc"]
            f = r["fault"]
            tcs[f"iscore_fault.p{f['step']}.L{f['layer']}."] = tcs[f"iscore.p{f['step']}.L{f['layer']}."]
        outs, dinfo = {}, {"units": [], "errors": {}, "source": f"kernels-{tag}.safetensors"}
        for base, tc in sorted(tcs.items()):
            dt, shape, raw = src[base + "vllm_logits"]
            stored = torch.frombuffer(bytearray(raw), dtype=torch.float32).cuda()
            w = width or stored.numel()
            lg = torch.full((1, w), float("-inf"), dtype=torch.float32, device="cuda")
            lg[0, :stored.numel()] = stored
            try:
                outs[base + "vllm_ptopk512"] = tbytes(call(lg, [tc])[0])
                dinfo["units"].append({"unit": base, "tc": tc, "width": w})
            except Exception as e:
                dinfo["errors"][base] = f"{type(e).__name__}: {e}"[-2000:]
        if synth:
            for nm, rows, tc0, step, w, seed, qn in PTOPK_EXTRA:
                gen = torch.Generator(device="cuda").manual_seed(seed)
                lg = torch.randn(rows, w, generator=gen, device="cuda")
                if qn:
                    lg = torch.round(lg / qn) * qn
                rtc = [tc0 + i * step for i in range(rows)]
                try:
                    o = call(lg, rtc)
                    for i in range(rows):
                        pre = f"ptopk.{nm}.r{i}."
                        outs[pre + "logits"] = tbytes(lg[i, :rtc[i]].contiguous())
                        outs[pre + "vllm_ptopk512"] = tbytes(o[i])
                    dinfo["units"].append({"unit": f"ptopk.{nm}", "rows": rows, "tc": rtc, "width": w, "seed": seed,
                                           "quantum": qn})
                except Exception as e:
                    dinfo["errors"][f"ptopk.{nm}"] = f"{type(e).__name__}: {e}"[-2000:]
        od = os.path.join(args.out, name)
        os.makedirs(od, exist_ok=True)
        write_safetensors(os.path.join(od, "kernels-ptopk.safetensors"), outs, {"producer": "capture/prodkernels/harness.py"})
        ok = op is not None and not dinfo["errors"]
        with open(os.path.join(od, "kernels-ptopk.json"), "w") as f:
            json.dump({"dump": name, "runs": {"vllm_persistent_topk": {"ok": ok, "error": json.dumps(
                {**info["errors"], **dinfo["errors"]})[:3000] if not ok else "", "seconds": round(time.time() - t0, 1)}},
                **info, **dinfo}, f, indent=1, sort_keys=True)
        print(f"ptopk {name}: {len(dinfo['units'])} units, errors {dinfo['errors'] or info['errors']}", flush=True)


def index_calls(torch, sg, vl, vtopk, u, pre, outs, info, ks, width=0):
    """One unit through the scorers and top-k's: SGLang's logits (width nb·64) and its top-k for each k in
    ks; vLLM's logits at `width` (its max_model_len; nb·64 when 0; stored up to nb·64) and vLLM's CUDA
    top-k on them (the insertion-sort path below 12,288 columns, the radix path from there)."""
    seq = torch.tensor([u["tc"]], dtype=torch.int32, device="cuda")
    msl = u["nb"] * PAGE_ENTRIES
    lg = sg["fp8_paged_mqa_logits_torch"](u["q"][None, None], u["cache"], u["w"][None], seq, u["table"],
                                          None, msl, False)
    outs[pre + "sglang_logits"] = tbytes(lg[0])
    for k in ks:
        pages = torch.full((1, k), -7, dtype=torch.int32, device="cuda")
        raw = torch.full((1, k), -7, dtype=torch.int32, device="cuda")
        sg["topk_transform_512_pytorch_vectorized"](lg, seq, u["table"], pages, PAGE_ENTRIES, raw)
        outs[pre + f"sglang_topk{k}.raw"] = tbytes(raw[0])
        outs[pre + f"sglang_topk{k}.pages"] = tbytes(pages[0])
    lv = None
    if vl is not None:
        try:
            lv = vl["fp8_paged_mqa_logits_torch"](u["q"][None, None], u["cache"], u["w"][None], seq, u["table"],
                                                  width or msl)
            outs[pre + "vllm_logits"] = tbytes(lv[0, :msl])
        except Exception as e:
            info["errors"][pre + "vllm"] = f"{type(e).__name__}: {e}"
    if vtopk is not None:
        src_lg = (lv if lv is not None else lg).contiguous()
        for k in ks:
            try:
                idx = torch.full((1, k), -7, dtype=torch.int32, device="cuda")
                vtopk(src_lg, 1, seq, idx, 1, src_lg.stride(0), src_lg.stride(1), k)
                torch.cuda.synchronize()
                outs[pre + f"vllm_topk{k}"] = tbytes(idx[0])
            except Exception as e:
                info["errors"][pre + f"vllm_topk{k}"] = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize()


def index_kernels(torch, src, vtopk_dir, info):
    """The scoring and top-k functions (run_index_score's docstring), what was taken recorded in info."""
    import typing
    f = torch.nn.functional
    sg = {"torch": torch, "F": f, "FP8_DTYPE": torch.float8_e4m3fn, "_arange_cache": {},
          "Optional": typing.Optional, "Any": typing.Any, "Tuple": typing.Tuple}
    info["functions"]["sglang"] = extract_functions(os.path.join(src, "sglang_src/indexer.py"),
                                                    ["fp8_paged_mqa_logits_torch", "topk_transform_512_pytorch_vectorized"], sg)
    vl = {"torch": torch, "F": f}
    try:
        from vllm.platforms import current_platform
        vl["current_platform"] = current_platform
        info["functions"]["vllm"] = extract_functions(os.path.join(src, "vllm_src/rocm_aiter_mla_sparse.py"),
                                                      ["fp8_paged_mqa_logits_torch"], vl)
    except Exception as e:
        info["errors"]["vllm_extract"] = f"{type(e).__name__}: {e}"
        vl = None
    vtopk = None
    if vtopk_dir:
        try:
            t0 = time.time()
            vtopk = vllm_topk_load(os.path.join(src, "vllm_csrc"), vtopk_dir)
            info["vllm_topk_build_s"] = round(time.time() - t0, 1)
            import hashlib
            for rel in VLLM_TOPK_FILES:
                info.setdefault("vllm_csrc_sha256", {})[rel] = hashlib.sha256(
                    open(os.path.join(src, "vllm_csrc", rel), "rb").read()).hexdigest()
        except Exception as e:
            info["errors"]["vllm_topk_build"] = f"{type(e).__name__}: {e}"[-3000:]
    return sg, vl, vtopk


# Synthetic units at V4-Flash indexer dims: 64 heads x 128, Tc past the top-k of 512.
INDEX_SYNTH = [  # name, Tc, seed, weight std
    ("s0", 520, 1, 0.1), ("s1", 1000, 2, 0.1), ("s2", 2048, 3, 0.1), ("s3", 2048, 4, 1.0),
]


def index_synth(args):
    """The scorers and top-k's on synthetic units: q, k ~ N(0, 1) (fp32, then E4M3 with power-of-two
    scales as index_unit), head weights bf16(N(0, std)), torch's CUDA generator seeded per unit; k = 512
    (V4's index_topk); vLLM's logits at width 16,384 (a max_model_len past 12,288, vLLM's radix-sort
    top-k path). Inputs and outputs land in OUT/kernels-index-synth.{safetensors,json}."""
    import torch
    out = args.out
    os.makedirs(out, exist_ok=True)
    write_stubs(args.src, os.path.join(out, "_pkg"))
    info = {"functions": {}, "units": [], "errors": {}, "synth_cases": INDEX_SYNTH, "heads": 64, "dim": 128}
    import triton
    info["env"] = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                   "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    sg, vl, vtopk = index_kernels(torch, args.src, args.vllm_topk, info)
    outs = {}
    for name, tc, seed, wstd in INDEX_SYNTH:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(64, 128, generator=gen, device="cuda")
        k = torch.randn(tc, 128, generator=gen, device="cuda")
        w = (torch.randn(64, generator=gen, device="cuda") * wstd).bfloat16().float()
        u = make_index_unit(torch, q, k, w)
        pre = f"isynth.{name}."
        for nm in ("q", "k"):
            outs[pre + nm + "_fp8"] = tbytes(u[nm].view(torch.uint8))
        outs[pre + "q_scale"], outs[pre + "k_scale"] = tbytes(u["sq"]), tbytes(u["sk"])
        outs[pre + "weights"], outs[pre + "page_table"] = tbytes(u["w"]), tbytes(u["table"][0])
        outs[pre + "iw"] = tbytes(w.bfloat16())
        index_calls(torch, sg, vl, vtopk, u, pre, outs, info, (512,), width=16384)
        info["units"].append({"case": name, "tc": tc, "exact": u["exact"]})
        print(f"index-synth {name}: Tc {tc} ok", flush=True)
    write_safetensors(os.path.join(out, "kernels-index-synth.safetensors"), outs, {"producer": "capture/prodkernels/harness.py"})
    with open(os.path.join(out, "kernels-index-synth.json"), "w") as f:
        json.dump({"runs": {"index_synth": {"ok": True}}, **info}, f, indent=1, sort_keys=True)


def run_index_score(g, outs, torch, src, vtopk_dir=""):
    """SGLang's torch scoring `fp8_paged_mqa_logits_torch` (its SGLANG_FP8_PAGED_MQA_LOGITS_TORCH path)
    and top-k `topk_transform_512_pytorch_vectorized` (SGLANG_TOPK_TRANSFORM_512_TORCH), vLLM's
    `fp8_paged_mqa_logits_torch` (its ROCm module's torch scorer, "taken from" DeepGEMM's test), on
    every (step, CSA layer) with Tc > 0; the top-k with k = index_topk and with SGLang's own 512. One
    faulted call: the last unit again with the K scale of row Tc // 2 doubled. With vtopk_dir (a
    `vllm-topk-build` folder; the build is repeated there, cached), vLLM's CUDA top_k_per_row_decode
    on vLLM's logits (SGLang's where vLLM's scorer failed), k = index_topk and 512."""
    info = {"functions": {}, "units": [], "errors": {}}
    sg, vl, vtopk = index_kernels(torch, src, vtopk_dir, info)
    ktop = g.cfg["index_topk"]
    layers = [l for l in range(g.cfg["n_layers"]) if g.ratio(l) == 4]
    units = [(p, l) for p in g.steps for l in layers if g.files[p][f"L{l}.index_score"][1][0] > 0]

    for p, l in units:
        u = index_unit(g, torch, p, l)
        pre = f"iscore.p{p}.L{l}."
        for nm in ("q", "k"):
            outs[pre + nm + "_fp8"] = tbytes(u[nm].view(torch.uint8))
        outs[pre + "q_scale"], outs[pre + "k_scale"] = tbytes(u["sq"]), tbytes(u["sk"])
        outs[pre + "weights"], outs[pre + "page_table"] = tbytes(u["w"]), tbytes(u["table"][0])
        index_calls(torch, sg, vl, vtopk, u, pre, outs, info, (ktop, 512))
        info["units"].append({"step": p, "layer": l, "tc": u["tc"], "exact": u["exact"]})
    p, l = units[-1]
    u = index_unit(g, torch, p, l)
    row = u["tc"] // 2
    pg, o = u["nb"] - row // PAGE_ENTRIES, row % PAGE_ENTRIES
    off = PAGE_ENTRIES * 128 + o * 4
    c = u["cache"].view(u["nb"] + 1, -1)
    s2 = (u["sk"][row:row + 1] * 2).contiguous().view(torch.uint8)
    c[pg, off:off + 4] = s2
    index_calls(torch, sg, vl, vtopk, u, f"iscore_fault.p{p}.L{l}.", outs, info, (ktop, 512))
    info["fault"] = {"step": p, "layer": l, "row": row, "what": "K scale of this row doubled in its page"}
    info["index_topk"], info["page_entries"] = ktop, PAGE_ENTRIES
    return info


# ---------------------------------------------------------------- compressors (pooling + norm + RoPE [+ quantised write])

def compressor_window(g, p, l, kind):
    """The (kv, score) rows a compressor emitting at step p pools, from the dumped state: r = 4
    (overlap): the previous group's 4 full-width rows from the state after step p-1 (rows 0..3),
    then the current group's rows 4..7 after step p; r = 128: the 128 live rows after step p.
    Scores already hold ape (the dump's score_state). Returns kv, score [coff*r, coff*d] fp32 and
    the positions of the rows (p-coff*r+1 .. p)."""
    torch = g.torch
    pre = "L%d.%s" % (l, "cmp" if kind == "main" else "icmp")
    r = g.ratio(l)
    if r == 4:
        if (p - 1) not in g.files or not g.has(p - 1, pre + "_kv_state"):
            raise KeyError(f"no state after step {p - 1}")
        kv = torch.cat([g.t(p - 1, pre + "_kv_state")[:4], g.t(p, pre + "_kv_state")[4:8]])
        sc = torch.cat([g.t(p - 1, pre + "_score_state")[:4], g.t(p, pre + "_score_state")[4:8]])
    else:
        kv, sc = g.t(p, pre + "_kv_state"), g.t(p, pre + "_score_state")
        if kv.shape[0] != r:
            raise ValueError(f"{pre}_kv_state has {kv.shape[0]} rows at an emission step")
    pos = list(range(p - kv.shape[0] + 1, p + 1))
    return kv.float().contiguous(), sc.float().contiguous(), pos


def emissions(g, kind):
    """(step, layer) of every dumped emission the compressor of kind computes."""
    out = []
    for p in g.steps:
        for l in range(g.cfg["n_layers"]):
            r = g.ratio(l)
            if r == 0 or (kind == "indexer" and r != 4):
                continue
            if (p + 1) % r == 0 and g.has(p, "L%d.%s_row" % (l, "cmp" if kind == "main" else "icmp")):
                out.append((p, l))
    return out


def run_vllm_compress(g, outs, torch, kind, fp4):
    """vLLM's fused compress -> RMSNorm -> RoPE -> quantised cache insert (one program per token),
    given the pooled window through vLLM's paged per-token state cache (block size 64, block b in
    page nb-b) and writing the row into a paged cache (row j of the compressed cache, block size 64)."""
    from types import SimpleNamespace
    from vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache import compress_norm_rope_store_triton
    d = 512 if kind == "main" else g.cfg["index_head_dim"]
    tag = {("main", False): "vllm_cmp", ("indexer", False): "vllm_icmp8", ("indexer", True): "vllm_icmp4"}[(kind, fp4)]
    if kind == "main":
        ts, sd, qb = MODEL1_DATA, MODEL1_SCALE, 64
    elif fp4:
        ts, sd, qb = d // 2, d // 32, 32
    else:
        ts, sd, qb = d, 4, d
    done = []
    for p, l in emissions(g, kind):
        r = g.ratio(l)
        coff = 2 if r == 4 else 1
        kv, sc, pos = compressor_window(g, p, l, kind)
        sw = coff * d
        nb = (p + PAGE_ENTRIES) // PAGE_ENTRIES
        st_table = [nb - b for b in range(nb)]
        state = torch.zeros((nb + 1, PAGE_ENTRIES, 2 * sw), dtype=torch.float32, device="cuda")
        for i, t in enumerate(pos):
            if t < 0:
                continue
            state[st_table[t // PAGE_ENTRIES], t % PAGE_ENTRIES, :sw] = kv[i]
            state[st_table[t // PAGE_ENTRIES], t % PAGE_ENTRIES, sw:] = sc[i]
        j = p // r
        ctable, cn = block_table(j + 1)
        eb = ts + sd
        blk = (PAGE_ENTRIES * eb + 575) // 576 * 576 if kind == "main" else PAGE_ENTRIES * eb
        cache_flat = torch.zeros((cn, blk), dtype=torch.uint8, device="cuda")
        cache = cache_flat.as_strided((cn, PAGE_ENTRIES, eb), (blk, eb, 1))
        kvslot = slot_of(j, ctable)
        pre = "layers.%d.attn.%s" % (l, "compressor" if kind == "main" else "indexer.compressor")
        w = g.conv(g.weights[pre + ".norm.weight"]).float().contiguous()
        i64 = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")
        compress_norm_rope_store_triton(
            state, 1, torch.zeros(1, dtype=torch.int32, device="cuda"), i64([p]),
            i64([slot_of(p, st_table)]),
            torch.tensor([st_table], dtype=torch.int32, device="cuda"), PAGE_ENTRIES, sw,
            g.cos_sin(l), cache, SimpleNamespace(slot_mapping=i64([kvslot])), {}, d, 64, r, r == 4, fp4,
            w, g.cfg["norm_eps"], qb, ts, sd)
        torch.cuda.synchronize()
        host = cache_flat.cpu()[ctable[j // PAGE_ENTRIES]].numpy().tobytes()
        e = j % PAGE_ENTRIES
        ent = host[e * ts:(e + 1) * ts] + host[PAGE_ENTRIES * ts + e * sd:PAGE_ENTRIES * ts + (e + 1) * sd]
        outs[f"{tag}.p{p}.L{l}.entry"] = ("U8", [len(ent)], ent)
        done.append([p, l, j])
    if not done:
        raise RuntimeError("no emission step in the dump")
    return {"units": done, "token_stride": ts, "scale_dim": sd, "quant_block": qb, "state_block": PAGE_ENTRIES}


def run_sglang_pool(g, outs, torch, kind, repeat=0):
    """SGLang's fused_ape_pool_norm_rope (its Triton pooling + RMSNorm + RoPE kernel, from the HIP
    compressor file) over the dumped window. The dumped scores already hold ape, so the kernel's
    ape is zero (its in-kernel ape add is then exact). Output: the fp32 normed, roped row."""
    from sglang.srt.layers.attention.dsv4.fused_compress_triton import fused_ape_pool_norm_rope
    d = 512 if kind == "main" else g.cfg["index_head_dim"]
    tag = "sglang_pool" if kind == "main" else "sglang_ipool"
    if repeat:
        tag += "_rep"
    done = []
    for p, l in emissions(g, kind):
        r = g.ratio(l)
        coff = 2 if r == 4 else 1
        kv, sc, pos = compressor_window(g, p, l, kind)
        gathered = torch.cat([kv, sc], dim=1).unsqueeze(0).contiguous()  # [1, coff*r, 2*coff*d]
        ape = torch.zeros((r, coff * d), dtype=torch.float32, device="cuda")
        pre = "layers.%d.attn.%s" % (l, "compressor" if kind == "main" else "indexer.compressor")
        w = g.conv(g.weights[pre + ".norm.weight"]).float().contiguous()
        fc = g.conv(g.rope["freqs_cis_cmp"])  # [T, 32, 2]
        j = p // r
        freqs = fc[j * r].reshape(1, 64).float().contiguous()  # interleaved (cos, sin) pairs
        if repeat:
            rows = []
            for _ in range(repeat):
                rows.append(fused_ape_pool_norm_rope(gathered, ape, w, g.cfg["norm_eps"], freqs, d, 64, r, r == 4).reshape(-1))
                torch.cuda.synchronize()
            outs[f"{tag}.p{p}.L{l}.rows"] = tbytes(torch.stack(rows))
            done.append([p, l, j])
            continue
        out = fused_ape_pool_norm_rope(gathered, ape, w, g.cfg["norm_eps"], freqs, d, 64, r, r == 4)
        torch.cuda.synchronize()
        outs[f"{tag}.p{p}.L{l}.row"] = tbytes(out.reshape(-1))
        done.append([p, l, j])
    if not done:
        raise RuntimeError("no emission step in the dump")
    return {"units": done, "ape": "zero (scores hold ape)"}


# ---------------------------------------------------------------- FlashMLA: build the sparse decode path, run it

# Our own binding (not FlashMLA's api.cpp, which also binds the dense and prefill paths): the one
# function sparse_attn_decode_interface of FlashMLA's csrc/api/sparse_decode.h, unchanged.
FLASHMLA_BINDING = """#include <pybind11/pybind11.h>
#include "api/sparse_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
"""

# The sources the sm90 sparse decode path needs (FlashMLA setup.py's list, cut to them): the
# scheduler, the combine, the sm90 MODEL1 kernel for 64 heads. The V32 and 128-head sm90 kernels and
# the sm100 kernels sparse_decode.h also names are not built: the module is linked and loaded with
# lazy binding and never calls them on sm90 with 64 heads.
FLASHMLA_SOURCES = [
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
]


def flashmla_load(csrc, cutlass, out):
    """Build (or load the built) module flash_mla_sparse_decode into out with torch's JIT
    extension builder, FlashMLA setup.py's flags for sm_90a (minus -v/-lineinfo/--source-in-ptx)."""
    from torch.utils.cpp_extension import load
    os.makedirs(out, exist_ok=True)
    b = os.path.join(out, "sparse_decode_binding.cpp")
    with open(b, "w") as f:
        f.write(FLASHMLA_BINDING)
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    try:
        return load(
            name="flash_mla_sparse_decode",
            sources=[b] + [os.path.join(csrc, s) for s in FLASHMLA_SOURCES],
            extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
            extra_cuda_cflags=[
                "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
                "--ptxas-options=--register-usage-level=10",
                "-gencode", "arch=compute_90a,code=sm_90a"],
            extra_include_paths=[csrc, os.path.join(csrc, "kerutils", "include"), os.path.join(csrc, "sm90"),
                                 os.path.join(cutlass, "include"), os.path.join(cutlass, "tools", "util", "include")],
            extra_ldflags=["-Wl,-z,lazy"],
            build_directory=out, verbose=True)
    finally:
        sys.setdlopenflags(flags)


def flashmla_synth(args):
    """FlashMLA on the synthetic V4-Flash inputs of prodkernel.FlashInput (flashmla-in.safetensors):
    one call per case, the index lists mapped to physical slots through the case's block table; the
    'dropped-split' case is called twice, the second time with the first call's scheduler metadata
    and num_splits of request 0 one short (the combine then merges all but its last split)."""
    import torch
    fm = flashmla_load(args.csrc, args.cutlass, args.module)
    st = read_safetensors(args.input)
    conv = lambda e: to_cuda(torch, e)
    pages = conv(st["kv.pages"])
    nphys, pb = pages.shape
    eb = MODEL1_DATA + MODEL1_SCALE
    kv = pages.as_strided((nphys, PAGE_ENTRIES, 1, eb), (pb, eb, eb, 1))
    sink = conv(st["sink"]).contiguous()
    cases = sorted(k[:-2] for k in st if k.endswith(".q"))
    outs, info = {}, {"env": {"torch": torch.__version__, "cuda": torch.version.cuda,
                              "gpu": torch.cuda.get_device_name(0),
                              "sms": str(torch.cuda.get_device_properties(0).multi_processor_count),
                              "python": sys.version.split()[0]}, "cases": {}}
    meta = json.loads(open(args.input, "rb").read(8 + struct.unpack("<Q", open(args.input, "rb").read(8))[0])[8:]).get("__metadata__", {})
    for c in cases:
        t0 = time.time()
        try:
            q = conv(st[c + ".q"]).contiguous()
            idx = conv(st[c + ".idx"]).long()
            table = conv(st[c + ".block_table"]).long()
            phys = torch.where(idx >= 0, table[idx.clamp(min=0) // PAGE_ENTRIES] * PAGE_ENTRIES + idx.clamp(min=0) % PAGE_ENTRIES,
                               torch.full_like(idx, -1)).int().contiguous()
            res = fm.sparse_decode_fwd(q, kv, phys, None, sink, None, None, None, None, None, 512, 512 ** -0.5)
            torch.cuda.synchronize()
            out, lse, sched, ns = res
            again = fm.sparse_decode_fwd(q, kv, phys, None, sink, None, None, None, None, None, 512, 512 ** -0.5)
            torch.cuda.synchronize()
            ci = {"b": q.shape[0], "s_q": q.shape[1], "topk": phys.shape[2], "num_sm_parts": sched.shape[0],
                  "num_splits": ns.tolist(), "repeat_bitwise_equal": bool(torch.equal(again[0], out) and torch.equal(again[1], lse)),
                  "fault": meta.get(c + ".fault", "")}
            if ci["fault"] == "dropped-split":
                ns2 = ns.clone()
                if ns2[1] - ns2[0] < 3:
                    raise RuntimeError(f"request 0 has {int(ns2[1] - ns2[0])} splits")
                ns2[1:] -= 1
                res2 = fm.sparse_decode_fwd(q, kv, phys, None, sink, sched, ns2, None, None, None, 512, 512 ** -0.5)
                torch.cuda.synchronize()
                ci["num_splits_given"] = ns2.tolist()
                ci["clean_o_sha_differs"] = not torch.equal(res2[0], out)
                out, lse = res2[0], res2[1]
                outs[c + ".o_clean"] = tbytes(res[0])
            outs[c + ".o"] = tbytes(out)  # [B, SQ, H, 512] bf16
            outs[c + ".lse"] = tbytes(lse.contiguous())  # [B, H, SQ] fp32 (natural log, no sink)
            outs[c + ".num_splits"] = tbytes(ns)
            outs[c + ".sched"] = tbytes(sched)  # [num_sm_parts, 8] int32 DecodingSchedMeta (FlashMLA params.h)
            ci["seconds"] = round(time.time() - t0, 3)
            ci["ok"] = True
            info["cases"][c] = ci
            print(f"[flashmla-synth] {c}: ok {ci}", flush=True)
        except Exception as e:
            info["cases"][c] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"[flashmla-synth] {c}: FAILED {type(e).__name__}: {e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_safetensors(os.path.join(args.out, "kernels-flashmla.safetensors"), outs, {"producer": "capture/prodkernels/harness.py flashmla-synth"})
    with open(os.path.join(args.out, "kernels-flashmla.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)


def run_flashmla(g, outs, torch, fin, name):
    """FlashMLA's sparse decode (MODEL1 FP8 pages written by sparsemla's kvcache, testdata/kernels
    README) on the dumped q, attn_sink and topk_idxs. The golden has 4 heads; FlashMLA takes 64 or 128,
    so heads are tiled 16x (head h + 4k is a copy of head h) and the copies are checked equal."""
    if not fin:
        raise RuntimeError("no --flashmla-in folder given")
    # Built beforehand (testdata/kernels/README.md) as the module flash_mla_sparse_decode: FlashMLA's
    # sparse_attn_decode_interface with its sm90 MODEL1 kernels only. The sm100 kernels the interface
    # also names are not built, so the module is loaded with lazy binding (never called on sm90).
    import importlib
    sys.path.insert(0, fin)
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    try:
        fm = importlib.import_module("flash_mla_sparse_decode")
    finally:
        sys.setdlopenflags(flags)
    pg = read_safetensors(os.path.join(fin, name, "pages.safetensors"))
    H = g.cfg["n_heads"]
    HQ = 64
    rep = HQ // H
    info = {"units": 0, "copies_equal": True}
    for p in g.steps:
        for l in range(g.cfg["n_layers"]):
            key = f"p{p}.L{l}"
            pages = g.conv(pg[f"{key}.pages"])  # [nphys, page bytes] u8
            table = g.conv(pg[f"{key}.block_table"]).tolist()
            nphys = pages.shape[0]
            eb = MODEL1_DATA + MODEL1_SCALE  # FlashMLA's bytes_per_token; the page keeps its padded stride
            kv = pages.as_strided((nphys, PAGE_ENTRIES, 1, eb), (pages.stride(0), eb, eb, 1))
            idx = g.t(p, f"L{l}.topk_idxs").tolist()
            phys = [slot_of(i, table) if i >= 0 else -1 for i in idx]
            phys += [-1] * (-len(phys) % 64)
            indices = torch.tensor(phys, dtype=torch.int32, device="cuda").view(1, 1, -1)
            q = g.t(p, f"L{l}.q").repeat(rep, 1).view(1, 1, HQ, 512).contiguous()
            sink = g.conv(g.weights[f"layers.{l}.attn.attn_sink"]).float().repeat(rep).contiguous()
            res = fm.sparse_decode_fwd(q, kv, indices, None, sink, None, None, None, None, None, 512, 512 ** -0.5)
            out, lse = res[0], res[1]
            torch.cuda.synchronize()
            o = out.view(HQ, 512)
            for k in range(1, rep):
                if not torch.equal(o[k * H:(k + 1) * H], o[:H]):
                    info["copies_equal"] = False
            outs[f"flashmla.{key}.o"] = tbytes(o[:H])
            outs[f"flashmla.{key}.lse"] = tbytes(lse.reshape(-1)[:H].float())
            outs[f"flashmla.{key}.num_splits"] = tbytes(res[3].reshape(-1))
            info["units"] += 1
    return info


def main():
    import argparse
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--src", default=".kern")
    r.add_argument("--out", required=True)
    r.add_argument("--flashmla-in", default="")
    r.add_argument("--only", default="", help="run only the kernels whose name contains this")
    r.add_argument("--skip", default="", help="skip the kernels whose name contains this")
    r.add_argument("--tag", default="all", help="output files are kernels-TAG.safetensors / .json")
    r.add_argument("--vllm-topk", default="", help="build folder for vLLM's top-k (sampler.cu); empty: not run")
    r.add_argument("--repeat", type=int, default=20, help="calls per unit of the _repeat run")
    r.add_argument("dirs", nargs="+")
    b = sub.add_parser("flashmla-build")
    b.add_argument("--csrc", required=True)
    b.add_argument("--cutlass", required=True)
    b.add_argument("--module", required=True, help="build folder; the module lands here")
    fs = sub.add_parser("flashmla-synth")
    fs.add_argument("--csrc", required=True)
    fs.add_argument("--cutlass", required=True)
    fs.add_argument("--module", required=True)
    fs.add_argument("--input", required=True, help="flashmla-in.safetensors (prodkernel TestFlashInput)")
    fs.add_argument("--out", required=True)
    vt = sub.add_parser("vllm-topk-build")
    vt.add_argument("--csrc", required=True, help="folder holding vLLM's csrc/ files (README)")
    vt.add_argument("--module", required=True)
    xs = sub.add_parser("index-synth")
    xs.add_argument("--src", default=".kern")
    xs.add_argument("--out", required=True)
    xs.add_argument("--vllm-topk", default="", help="build folder for vLLM's top-k; empty: not run")
    pt = sub.add_parser("ptopk")
    pt.add_argument("--csrc", required=True, help="folder holding vLLM's csrc/ files (README)")
    pt.add_argument("--module", required=True, help="build folder")
    pt.add_argument("--out", required=True)
    pt.add_argument("dirs", nargs="+", help="testdata/kernels/<dump> folders holding kernels-index{,-synth}")
    sub.add_parser("selftest")
    a = ap.parse_args()
    if a.cmd == "selftest":
        selftest()
    elif a.cmd == "flashmla-build":
        t0 = time.time()
        flashmla_load(a.csrc, a.cutlass, a.module)
        print(f"flashmla-build: ok ({time.time() - t0:.0f}s)", flush=True)
    elif a.cmd == "vllm-topk-build":
        t0 = time.time()
        vllm_topk_load(a.csrc, a.module)
        print(f"vllm-topk-build: ok ({time.time() - t0:.0f}s)", flush=True)
    elif a.cmd == "ptopk":
        ptopk_run(a)
    elif a.cmd == "index-synth":
        index_synth(a)
    elif a.cmd == "flashmla-synth":
        flashmla_synth(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
