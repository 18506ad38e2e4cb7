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

In a serving process use ``Dumper.from_env()`` (SPARSEMLA_CAPTURE=1,
SPARSEMLA_CAPTURE_DIR, SPARSEMLA_CAPTURE_FILTER) and ``hook_modules``: hooks
never raise (an error is logged and the dumper disables itself), a module that
runs twice in one step is dumped once (later calls are logged and skipped),
batch > 1 is split by request (``at(requests=[...], steps=[...])``), and dumps
made while a CUDA graph is being captured are copies into static buffers
recorded inside the graph, written by ``graph_replayed()`` after each replay.

Tensors are cloned on their device when dump() is called (so later in-place
ops cannot change what is written) and copied to the host at flush(), at the
end of each ``at()`` block, or when the pending bytes exceed ``max_pending``.
"""

import json
import logging
import os
import re
import struct
from contextlib import contextmanager

import msgpack
import torch

log = logging.getLogger("sparsemla_capture")

ENV_ENABLE = "SPARSEMLA_CAPTURE"          # "1" / "true" enables from_env()
ENV_DIR = "SPARSEMLA_CAPTURE_DIR"         # output directory (default /tmp/sparsemla_capture)
ENV_FILTER = "SPARSEMLA_CAPTURE_FILTER"   # regex searched in "L<layer>.<stage>" (global: "G.<stage>")
ENV_SPLIT = "SPARSEMLA_CAPTURE_SPLIT"     # "step" = one file per step (default), "none" = one file


def _capturing():
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


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
    tp_rank, tp_size  tensor-parallel rank of this process (default: from
             torch.distributed when it is initialised, else 0 / 1). With
             tp_size > 1 file names carry ``.tp<rank>`` and dump(shard_dim=d)
             marks a record as rank's shard along d (merged on read).
    filter   regex searched in "L<layer>.<stage>" ("G.<stage>" for global
             records); records that do not match are not dumped.
    """

    def __init__(self, path, config=None, compress_ratios=None, dtype_policy=None,
                 producer=None, user=None, split=None, max_pending=1 << 30,
                 tp_rank=None, tp_size=None, filter=None, enabled=True):
        if isinstance(config, dict):
            config_json = json.dumps(config)
        else:
            config_json = config or ""
        if compress_ratios is None and config_json:
            compress_ratios = json.loads(config_json).get("compress_ratios")
        if tp_rank is None or tp_size is None:
            r, n = 0, 1
            try:
                import torch.distributed as dist
                if dist.is_available() and dist.is_initialized():
                    r, n = dist.get_rank(), dist.get_world_size()
            except Exception:
                pass
            tp_rank = r if tp_rank is None else tp_rank
            tp_size = n if tp_size is None else tp_size
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        prod = {str(k): str(v) for k, v in (producer or {}).items()}
        if self.tp_size > 1:
            prod["tp_rank"], prod["tp_size"] = str(self.tp_rank), str(self.tp_size)
        self.header = {
            "model_args": config_json,
            "compress_ratios": list(compress_ratios or []),
            "dtype_policy": dict(dtype_policy or {}),
            "producer": prod,
            "user": {str(k): str(v) for k, v in (user or {}).items()},
        }
        if split not in (None, "step"):
            raise ValueError("sparsemla_capture: split must be None or 'step'")
        self.path, self.split = path, split
        self.enabled = bool(enabled)
        if split and self.enabled:
            os.makedirs(path, exist_ok=True)
        self.max_pending = max_pending
        self.filter = re.compile(filter) if filter else None
        self.step = -1
        self.request = ""
        self.requests = None     # batch rows -> request ids (at(requests=...))
        self.steps = None        # batch rows -> absolute positions
        self._pending = []       # (meta, tensor clone, dtype override)
        self._pending_bytes = 0
        self._files = {}         # file name -> open file
        self._counts = {}        # file name -> tensor frames written
        self._seen = set()
        self._warned = set()
        self._graph = None       # tag of the CUDA graph being captured
        self._graph_bufs = {}    # tag -> [(meta without step/request, static buffer, dtype, batch)]
        self.errors = []         # messages of the errors that disabled hooks

    @classmethod
    def from_env(cls, name="capture", **kwargs):
        """A Dumper configured by the environment: enabled only when
        SPARSEMLA_CAPTURE is 1/true; SPARSEMLA_CAPTURE_DIR is the output
        directory (``<dir>/<name>[.tp<r>]/step_<p>.smd``, or ``<dir>/<name>.smd`` with
        SPARSEMLA_CAPTURE_SPLIT=none); SPARSEMLA_CAPTURE_FILTER selects records.
        A disabled Dumper creates no file and its hooks cost one attribute test."""
        on = os.environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")
        out = os.environ.get(ENV_DIR, "/tmp/sparsemla_capture")
        flt = os.environ.get(ENV_FILTER) or kwargs.pop("filter", None)
        split = os.environ.get(ENV_SPLIT, "step").strip().lower()
        split = None if split == "none" else "step"
        path = os.path.join(out, name if split else name + ".smd")
        return cls(path, split=split, filter=flt, enabled=on, **kwargs)

    # -- context -----------------------------------------------------------
    @contextmanager
    def at(self, step=None, request=None, requests=None, steps=None):
        """Within the block, dump() defaults to this step (and request); the
        pending tensors are flushed at its end. For a batch, requests (one id
        per row) and steps (one absolute position per row) make every tensor
        whose first dimension is the batch split into one record per request."""
        old = (self.step, self.request, self.requests, self.steps)
        if step is not None:
            self.step = step
        if request is not None:
            self.request = request
        if requests is not None:
            if steps is None or len(steps) != len(requests):
                raise ValueError("sparsemla_capture: at(requests=...) needs steps of the same length")
            self.requests, self.steps = [str(r) for r in requests], [int(p) for p in steps]
        try:
            yield self
        finally:
            self.flush()
            self.step, self.request, self.requests, self.steps = old

    # -- records -----------------------------------------------------------
    def _selected(self, stage, layer):
        if self.filter is None:
            return True
        tag = ("G" if layer < 0 else "L%d" % layer) + "." + stage
        return self.filter.search(tag) is not None

    def dump(self, stage, tensor, layer=-1, step=None, request=None, kind="stage",
             name="", dtype=None, page=None, shard_dim=None, batch=False):
        """Snapshot tensor (clone on its device) as record (request, step, layer, stage).

        Batch/sequence dims of size 1 should be removed by the caller so shapes
        match the canonical stage table (dump/FORMAT.md). batch=True (with
        at(requests=...)) splits dimension 0 by request. shard_dim marks the
        tensor as this tensor-parallel rank's shard along that dimension."""
        if not self.enabled:
            return
        if kind not in KINDS:
            raise ValueError("sparsemla_capture: unknown kind %r" % (kind,))
        if not self._selected(str(stage), int(layer)):
            return
        meta = {"t": "tensor", "layer": int(layer), "stage": str(stage), "kind": kind,
                "name": name or str(stage)}
        if page is not None:
            meta["page"] = dict(page)
        if shard_dim is not None and self.tp_size > 1:
            meta["shard"] = {"rank": self.tp_rank, "size": self.tp_size, "dim": int(shard_dim)}
        t = tensor.detach().clone()
        if self._graph is not None or _capturing():
            # Inside CUDA-graph capture: the clone is a copy kernel recorded in
            # the graph into a buffer of the graph's pool that we keep alive;
            # every replay refills it, graph_replayed() writes it.
            if self._graph is None:
                raise RuntimeError("sparsemla_capture: dump() during CUDA-graph capture outside d.graph_capture()")
            self._graph_bufs[self._graph].append((meta, t, dtype, batch, step, request))
            return
        self._queue(meta, t, dtype, batch, step, request)

    def _queue(self, meta, t, dtype, batch, step, request):
        if batch and self.requests is not None:
            if t.dim() == 0 or t.shape[0] != len(self.requests):
                raise ValueError("sparsemla_capture: batch tensor %s has %s rows, at() has %d requests"
                                 % (meta["stage"], tuple(t.shape), len(self.requests)))
            for i, (rq, p) in enumerate(zip(self.requests, self.steps)):
                row = t[i]
                while row.dim() > 1 and row.shape[0] == 1:
                    row = row[0]
                self._queue_one(dict(meta), row, dtype, p if step is None else step, rq if request is None else request)
            return
        self._queue_one(meta, t, dtype, self.step if step is None else step,
                        self.request if request is None else request)

    def _queue_one(self, meta, t, dtype, step, request):
        key = (str(request), int(step), meta["layer"], meta["stage"], meta["kind"])
        if key in self._seen:
            raise ValueError("sparsemla_capture: duplicate record %r" % (key,))
        self._seen.add(key)
        meta["request"], meta["step"] = key[0], key[1]
        self._pending.append((meta, t, dtype))
        self._pending_bytes += t.numel() * t.element_size()
        if self._pending_bytes >= self.max_pending:
            self.flush()

    def seen(self, stage, layer=-1, step=None, request=None, kind="stage"):
        """Whether (request, step, layer, stage, kind) was dumped already."""
        step = self.step if step is None else step
        request = self.request if request is None else request
        return (str(request), int(step), int(layer), str(stage), kind) in self._seen

    def hook_dump(self, stage, tensor, layer=-1, transform=None, batch=None):
        """dump() for hooks: never raises. A record already dumped in this step
        (a module that runs twice) is skipped with a warning; any other error is
        logged and disables the dumper, so the serving process keeps running."""
        if not self.enabled:
            return
        try:
            if batch is None:
                batch = self.requests is not None
            if not batch:
                while tensor.dim() > 1 and tensor.shape[0] == 1:
                    tensor = tensor[0]
            if transform is not None:
                tensor = transform(tensor)
            if self._graph is None and not batch and self.seen(stage, layer):
                w = (stage, layer)
                if w not in self._warned:
                    self._warned.add(w)
                    log.warning("sparsemla_capture: %s of layer %d ran again in step %d: kept the first",
                                stage, layer, self.step)
                return
            if self._graph is not None and any(m["stage"] == stage and m["layer"] == layer
                                               for m, *_ in self._graph_bufs[self._graph]):
                return
            if batch and self.requests is not None and self.seen(stage, layer, step=self.steps[0], request=self.requests[0]):
                return
            self.dump(stage, tensor, layer=layer, batch=batch)
        except Exception as e:  # never raise into the model
            self.enabled = False
            msg = "sparsemla_capture: disabled after an error in the hook of %s (layer %d): %s: %s" % (
                stage, layer, type(e).__name__, e)
            self.errors.append(msg)
            log.error(msg)

    # -- CUDA graphs -------------------------------------------------------
    @contextmanager
    def graph_capture(self, tag="default"):
        """Wrap the model call inside ``torch.cuda.graph(g)``: dumps made in
        the block become static buffers recorded in the graph. After every
        ``g.replay()`` call ``graph_replayed(tag, step=...)`` to write them."""
        self._graph_bufs[tag] = []
        old, self._graph = self._graph, tag
        try:
            yield self
        finally:
            self._graph = old

    def graph_replayed(self, tag="default", step=None, request=None, requests=None, steps=None):
        """Write the static buffers of graph `tag` as records of this replay
        (step / request, or requests + steps for a batch). Copies to the host
        on the current stream (which must be the one replayed on)."""
        if not self.enabled:
            return
        with self.at(step=step, request=request, requests=requests, steps=steps):
            for meta, buf, dtype, batch, st, rq in self._graph_bufs.get(tag, []):
                self._queue(dict(meta), buf.clone(), dtype, batch, st, rq)

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
        if not self.enabled:
            return
        self.flush()
        self._write_frame(self._file_for(self.step), {"t": "prefix", "prefix": {
            "request": str(request), "source": str(source), "tokens": int(tokens)}, "shape": []}, b"")

    # -- output ------------------------------------------------------------
    def _file_for(self, step):
        tp = ".tp%d" % self.tp_rank if self.tp_size > 1 else ""
        if self.split:
            name = os.path.join(self.path, "step_%s%s.smd" % (step if step >= 0 else "none", tp))
        else:
            name = self.path
            if tp:
                root, ext = os.path.splitext(name)
                name = root + tp + (ext or ".smd")
        f = self._files.get(name)
        if f is None:
            d = os.path.dirname(name)
            if d:
                os.makedirs(d, exist_ok=True)
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
        """Copy pending clones to the host and write them (not while a CUDA
        graph is being captured: the copies wait for the next flush)."""
        if self._graph is not None or _capturing():
            return
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
        if not self.enabled and not self._files:
            self._pending = []
            return
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

    rules: list of (pattern, stage[, which[, transform]]) where pattern is a
    regex matched (fullmatch) against qualified module names and may capture
    (?P<layer>\\d+); stage is a str, "{name}"/"{leaf}" expand to the module
    name / its last component; which is "output" (default) or "input" (first
    positional argument, or the hidden_states keyword); transform, if given,
    maps the (squeezed) tensor before it is dumped (e.g. a reshape to the
    canonical [H, D]). Every matching rule applies, so one module can have an
    input and an output rule. Tuple outputs dump their first element. Tensors
    are squeezed of leading size-1 dims (batch, sequence); with
    ``dumper.at(requests=...)`` the first dim is the batch and is split by
    request. Hooks never raise (see Dumper.hook_dump). Returns the hook handles.
    """
    compiled = []
    for r in rules:
        compiled.append((re.compile(r[0]), r[1], r[2] if len(r) > 2 else "output", r[3] if len(r) > 3 else None))
    handles = []
    for mname, mod in model.named_modules():
        for rx, stage, which, tf in compiled:
            m = rx.fullmatch(mname)
            if not m:
                continue
            layer = int(m.group("layer")) if "layer" in rx.groupindex and m.group("layer") else -1
            st = stage.format(name=mname, leaf=mname.rsplit(".", 1)[-1])

            if which == "input":
                def pre(mod, args, kwargs, st=st, layer=layer, tf=tf):
                    if not dumper.enabled:
                        return
                    x = args[0] if args else kwargs.get("hidden_states")
                    if torch.is_tensor(x):
                        dumper.hook_dump(st, x, layer=layer, transform=tf)
                try:
                    handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                except TypeError:  # torch < 2.0: no keyword arguments in pre-hooks
                    handles.append(mod.register_forward_pre_hook(lambda m, a, pre=pre: pre(m, a, {})))
            else:
                def post(mod, args, out, st=st, layer=layer, tf=tf):
                    if not dumper.enabled:
                        return
                    if isinstance(out, (tuple, list)):
                        out = out[0] if out else None
                    if torch.is_tensor(out):
                        dumper.hook_dump(st, out, layer=layer, transform=tf)
                handles.append(mod.register_forward_hook(post))
    return handles


def hf_deepseek_v4_rules(n_heads, head_dim=512, index_n_heads=64, index_head_dim=128, rope_head_dim=64):
    """hook_modules rules for transformers' DeepseekV4ForCausalLM: its module
    names -> canonical stages, with the reshapes to the canonical shapes
    ([H, D] for q_b / o_inv, [IH, ID] for iq_b, the rope dims of the head-normed
    q for q_pe_prerope). Each transform keeps any leading batch dimensions, so
    the rules work with at(requests=...) too. Stages whose HF value differs in
    kind from the official one (e.g. cmp_a / cmp_b are bf16 projections of
    bf16 x in HF, fp32 in model.py) keep the official name: the replay
    reports the difference."""
    H, D, IH, ID = n_heads, head_dim, index_n_heads, index_head_dim

    def rs(*shape):
        return lambda t: t.reshape(*t.shape[:-1], *shape)

    L = r"model\.layers\.(?P<layer>\d+)"
    A = L + r"\.self_attn"
    return [
        (L, "h_in", "input"),
        (L, "h_out"),
        (A, "x", "input"),
        (A + r"\.q_a_proj", "q_a"),
        (A + r"\.q_a_norm", "cq"),
        (A + r"\.q_b_proj", "q_b", "output", rs(H, D)),
        (A + r"\.q_b_norm", "q_pe_prerope", "output",
         lambda t: t.reshape(*t.shape[:-3], H, D)[..., D - rope_head_dim:]),
        (A + r"\.kv_proj", "kv_raw"),
        (A + r"\.kv_norm", "kv_normed"),
        (A + r"\.o_a_proj", "o_inv", "input", lambda t: t.reshape(*t.shape[:-2], H, D)),
        (A + r"\.o_a_proj", "u"),
        (A + r"\.o_b_proj", "y"),
        (A + r"\.compressor\.kv_proj", "cmp_a"),
        (A + r"\.compressor\.gate_proj", "cmp_b"),
        (A + r"\.compressor\.kv_norm", "cmp_normed"),
        (A + r"\.compressor\.indexer\.kv_proj", "icmp_a"),
        (A + r"\.compressor\.indexer\.gate_proj", "icmp_b"),
        (A + r"\.compressor\.indexer\.kv_norm", "icmp_normed"),
        (A + r"\.compressor\.indexer\.q_b_proj", "iq_b", "output", rs(IH, ID)),
        (A + r"\.compressor\.indexer\.scorer\.weights_proj", "iw_raw"),
        (A + r"\.compressor\.indexer", "index_topk"),
        (L + r"\.post_attention_layernorm", "ffn_in"),
        (L + r"\.mlp", "ffn_out"),
        (r"lm_head", "logits"),
    ]


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
