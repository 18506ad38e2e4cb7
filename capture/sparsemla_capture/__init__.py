"""sparsemla_capture: write GPU tensors in the sparsemla native dump format.

The format (dump/FORMAT.md in the sparsemla repository):

    file   = b"SPMLDUMP" + u32le(version=1) + frame*
    frame  = u32le(len(meta)) + meta (msgpack map) + data (meta["nbytes"] raw bytes)

The first frame is the header (model config, layer schedule, dtype policy,
producer, user metadata); then one frame per tensor record keyed by
(request, step = absolute position p, layer (-1 = global), stage) or
prefix-cache hit; close() writes an end frame with the record count (a file
without it, e.g. after a crash, is still readable and reported incomplete).
Only torch and msgpack are needed.

Usage::

    from sparsemla_capture import Dumper
    d = Dumper("run.smd", config=model_args_dict, producer={"engine": "mine"})
    with d.at(step=p):                      # every dump() below is at decode step p
        d.dump("q", q, layer=3)             # snapshot now (GPU clone), written at flush
    d.close()

Tensors are cloned on their device when dump() is called (so later in-place
ops cannot change what is written) and copied to the host at flush(), at the
end of each ``at()`` block, or when the pending bytes exceed ``max_pending``.
"""

import json
import os
import re
import struct
from contextlib import contextmanager

import msgpack
import torch

MAGIC = b"SPMLDUMP"
VERSION = 1

# torch dtype -> (native dtype name, elements per stored element)
_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
}
for _name, _dt in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2"),
                   ("float8_e8m0fnu", "e8m0"), ("uint16", "u16"),
                   ("uint32", "u32"), ("uint64", "u64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _dt
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)

KINDS = ("stage", "state", "table", "page", "weight")

# Stage names of a V4 attention decode step (dump/stages.go has the full table).
STATE_STAGES = ("kv_cache", "cmp_kv_state", "cmp_score_state", "icache",
                "icmp_kv_state", "icmp_score_state")


def _encode(t, dtype=None):
    """Return (dtype name, shape, raw little-endian bytes) of a host tensor.

    dtype overrides the element type for raw integer storage, e.g. a uint8
    tensor holding e8m0 scale bytes (dtype="e8m0") or packed fp4 (dtype="fp4",
    shape = last dimension doubled).
    """
    shape = list(t.shape)
    if _FP4 is not None and t.dtype == _FP4:
        name = "fp4"
        shape = shape[:-1] + [shape[-1] * 2] if shape else [2]
    elif t.dtype in _DTYPES:
        name = _DTYPES[t.dtype]
    else:
        raise TypeError("sparsemla_capture: unsupported dtype %s" % t.dtype)
    if dtype is not None:
        if dtype == "fp4" and name == "u8":
            shape = shape[:-1] + [shape[-1] * 2]
        elif dtype in ("bf16", "f16") and name in ("i16", "u16"):
            pass
        elif dtype in ("e4m3", "e5m2", "e8m0") and name in ("u8", "i8"):
            pass
        elif dtype != name:
            raise TypeError("sparsemla_capture: cannot store %s as %s" % (name, dtype))
        name = dtype
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        data = b""
    else:
        data = flat.view(torch.uint8).numpy().tobytes()
    return name, shape, data


class Dumper:
    """Writes one native dump file, or a directory of per-step files.

    path     file name (``run.smd``) or, with split="step", a directory that
             receives ``step_<p>.smd`` files (each with the header).
    config   the official ModelArgs as a dict or JSON string (kept raw).
    compress_ratios  layer schedule; taken from config when omitted.
    dtype_policy, producer, user  string maps stored in the header.
    max_pending  bytes of GPU clones held before an automatic flush.
    """

    def __init__(self, path, config=None, compress_ratios=None, dtype_policy=None,
                 producer=None, user=None, split=None, max_pending=1 << 30):
        if isinstance(config, dict):
            config_json = json.dumps(config)
        else:
            config_json = config or ""
        if compress_ratios is None and config_json:
            compress_ratios = json.loads(config_json).get("compress_ratios")
        self.header = {
            "model_args": config_json,
            "compress_ratios": list(compress_ratios or []),
            "dtype_policy": dict(dtype_policy or {}),
            "producer": {str(k): str(v) for k, v in (producer or {}).items()},
            "user": {str(k): str(v) for k, v in (user or {}).items()},
        }
        if split not in (None, "step"):
            raise ValueError("sparsemla_capture: split must be None or 'step'")
        self.path, self.split = path, split
        if split:
            os.makedirs(path, exist_ok=True)
        self.max_pending = max_pending
        self.step = -1
        self.request = ""
        self._pending = []       # (meta, tensor clone, dtype override)
        self._pending_bytes = 0
        self._files = {}         # file name -> open file
        self._counts = {}        # file name -> tensor frames written
        self._seen = set()
        self.enabled = True

    # -- context -----------------------------------------------------------
    @contextmanager
    def at(self, step, request=None):
        """Within the block, dump() defaults to this step (and request); the
        pending tensors are flushed at its end."""
        old = (self.step, self.request)
        self.step = step
        if request is not None:
            self.request = request
        try:
            yield self
        finally:
            self.flush()
            self.step, self.request = old

    # -- records -----------------------------------------------------------
    def dump(self, stage, tensor, layer=-1, step=None, request=None, kind="stage",
             name="", dtype=None, page=None):
        """Snapshot tensor (clone on its device) as record (request, step, layer, stage).

        Batch/sequence dims of size 1 should be removed by the caller so shapes
        match the canonical stage table (dump/FORMAT.md)."""
        if not self.enabled:
            return
        if kind not in KINDS:
            raise ValueError("sparsemla_capture: unknown kind %r" % (kind,))
        step = self.step if step is None else step
        request = self.request if request is None else request
        key = (str(request), int(step), int(layer), str(stage), kind)
        if key in self._seen:
            raise ValueError("sparsemla_capture: duplicate record %r" % (key,))
        self._seen.add(key)
        t = tensor.detach().clone()
        meta = {"t": "tensor", "request": key[0], "step": key[1], "layer": key[2],
                "stage": key[3], "kind": kind, "name": name or key[3]}
        if page is not None:
            meta["page"] = dict(page)
        self._pending.append((meta, t, dtype))
        self._pending_bytes += t.numel() * t.element_size()
        if self._pending_bytes >= self.max_pending:
            self.flush()

    def dump_state(self, stage, tensor, layer, valid_after, request=None, dtype=None):
        """A replay start state (kv_cache, cmp_kv_state, ..., icache) valid after step valid_after."""
        self.dump(stage, tensor, layer=layer, step=valid_after, request=request, kind="state", dtype=dtype)

    def dump_table(self, stage, tensor, dtype=None):
        """A table the GPU built, e.g. freqs_cis_r0 as F32 [T, 32, 2] (cos, sin)."""
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        self.dump(stage, tensor, layer=-1, step=-1, kind="table", request="", dtype=dtype)

    def dump_page(self, stage, page_bytes, layer, layout, page_id, block_size, block_table, step=None, request=None):
        """Raw KV page bytes (uint8) with the layout id and the request's block table."""
        self.dump(stage, page_bytes.view(torch.uint8), layer=layer, step=step, request=request, kind="page",
                  page={"layout": layout, "page_id": int(page_id), "block_size": int(block_size),
                        "block_table": [int(b) for b in block_table]})

    def prefix_hit(self, request, source, tokens):
        """Request `request` reused the first `tokens` tokens of request `source`."""
        self.flush()
        self._write_frame(self._file_for(self.step), {"t": "prefix", "prefix": {
            "request": str(request), "source": str(source), "tokens": int(tokens)}, "shape": []}, b"")

    # -- output ------------------------------------------------------------
    def _file_for(self, step):
        name = self.path if not self.split else os.path.join(
            self.path, "step_%s.smd" % (step if step >= 0 else "none"))
        f = self._files.get(name)
        if f is None:
            f = open(name, "wb")
            f.write(MAGIC + struct.pack("<I", VERSION))
            self._write_frame(f, {"t": "header", "header": self.header}, b"")
            self._files[name] = f
            self._counts[name] = 0
        return f

    @staticmethod
    def _write_frame(f, meta, data):
        m = msgpack.packb(meta, use_bin_type=True)
        f.write(struct.pack("<I", len(m)))
        f.write(m)
        f.write(data)

    def flush(self):
        """Copy pending clones to the host and write them."""
        for meta, t, dtype in self._pending:
            name, shape, data = _encode(t.cpu(), dtype)
            meta.update(dtype=name, shape=shape, nbytes=len(data))
            f = self._file_for(meta["step"])
            self._write_frame(f, meta, data)
            self._counts[f.name] += 1
        self._pending, self._pending_bytes = [], 0
        for f in self._files.values():
            f.flush()

    def close(self):
        self.flush()
        if not self._files:
            self._file_for(self.step)   # an empty dump still has its header
        for name, f in self._files.items():
            self._write_frame(f, {"t": "end", "records": self._counts[name], "shape": []}, b"")
            f.close()
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def hook_modules(model, dumper, rules):
    """Register forward hooks that dump module inputs/outputs.

    rules: list of (pattern, stage, which) where pattern is a regex matched
    (fullmatch) against qualified module names and may capture (?P<layer>\\d+);
    stage is a str, "{name}"/"{leaf}" expand to the module name / its last
    component; which is "output" (default) or "input" (first positional
    argument). Every matching rule applies, so one module can have an input
    and an output rule. Tuple outputs dump their first element. Tensors are squeezed of
    leading size-1 dims (batch, sequence) to match the canonical shapes.
    Returns the hook handles (call .remove() on each to detach).
    """
    compiled = [(re.compile(p), s, w) for p, s, w in
                ((r[0], r[1], r[2] if len(r) > 2 else "output") for r in rules)]
    handles = []
    for mname, mod in model.named_modules():
        for rx, stage, which in compiled:
            m = rx.fullmatch(mname)
            if not m:
                continue
            layer = int(m.group("layer")) if "layer" in rx.groupindex and m.group("layer") else -1
            st = stage.format(name=mname, leaf=mname.rsplit(".", 1)[-1])

            def squeeze(t):
                while t.dim() > 1 and t.shape[0] == 1:
                    t = t[0]
                return t

            if which == "input":
                def pre(mod, args, st=st, layer=layer):
                    if args and torch.is_tensor(args[0]):
                        dumper.dump(st, squeeze(args[0]), layer=layer)
                handles.append(mod.register_forward_pre_hook(pre))
            else:
                def post(mod, args, out, st=st, layer=layer):
                    if isinstance(out, (tuple, list)):
                        out = out[0]
                    if torch.is_tensor(out):
                        dumper.dump(st, squeeze(out), layer=layer)
                handles.append(mod.register_forward_hook(post))
    return handles


# -- reading ----------------------------------------------------------------
_TORCH_OF = {v: k for k, v in _DTYPES.items()}


def _decode(meta, data):
    """Tensor of a tensor frame (CPU). fp4 comes back as float4_e2m1fn_x2
    (last dim halved) when torch has it, else as packed uint8 bytes."""
    name, shape = meta["dtype"], list(meta["shape"])
    if name == "fp4":
        packed = shape[:-1] + [shape[-1] // 2] if shape else []
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        t = t.reshape(packed)
        return t.view(_FP4) if _FP4 is not None else t
    dt = _TORCH_OF.get(name)
    if dt is None:
        raise ValueError("sparsemla_capture: unknown dtype %r" % (name,))
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)


def read(path):
    """Read a native dump file: returns (header, records, prefix_hits, complete)
    where records is a list of (meta, tensor) in file order and complete says
    whether the end frame was present. For checking captures from Python; the
    Go reader (sparsemla inspect) is the validating one."""
    with open(path, "rb") as f:
        b = f.read()
    if b[:8] != MAGIC:
        raise ValueError("%s: not a sparsemla dump" % path)
    (version,) = struct.unpack_from("<I", b, 8)
    if version != VERSION:
        raise ValueError("%s: format version %d, this reader knows %d" % (path, version, VERSION))
    off, header, records, prefix, complete = 12, None, [], [], False
    while off < len(b):
        (ml,) = struct.unpack_from("<I", b, off)
        meta = msgpack.unpackb(b[off + 4: off + 4 + ml], raw=False)
        off += 4 + ml
        n = meta.get("nbytes", 0)
        data = b[off: off + n]
        if len(data) != n:
            raise ValueError("%s: record at offset %d truncated" % (path, off))
        off += n
        t = meta.get("t")
        if t == "header":
            header = meta["header"]
        elif t == "tensor":
            records.append((meta, _decode(meta, data)))
        elif t == "prefix":
            prefix.append(meta["prefix"])
        elif t == "end":
            complete = True
    return header, records, prefix, complete
