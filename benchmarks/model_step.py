"""The model-step harness: gpt-oss at full size with random FP8 weights, on 1..N GPUs.

It runs the server's own decoder (sglang_ext/models/gpt_oss_core.py: the same modules, layer loop,
probe taps and collectives calls as `python -m sglang.launch_server` with this plugin) on a minimal
paged KV cache of its own instead of SGLang's, because the GPU image has no SGLang. What it adds around
the decoder: random weights, the embedding and LM head as plain tensors, an attention op over its cache
(`PagedAttention`, called as the server's RadixAttention is) and torch.distributed collectives
(`HarnessCollectives`: NCCL on GPUs, gloo on CPU for the tests).

Parallelism is SGLang's --tp/--ep/--dp as a `ParallelLayout` (sglang_ext.layers.parallel, world = tp):
attention heads over tp // dp ranks (dp > 1 is data-parallel attention, here with dp == tp), experts
in `ep` contiguous ranges, each expert's intermediate dimension over tp // ep ranks on the 128-block
grid (2880 at moe-TP 4 -> 768/768/768/576; rank 0, the busiest, is the one timed when modelled).
Under `emulate`, a single process builds rank 0's shard of a larger configuration and the collectives
are skipped; perf_model.py adds their modelled times (the "modelled" rows of bench_decode / bench_prefill).

KV cache: full-attention layers own `batch * context` slots; sliding layers a ring of 128
slots per request (SGLang's SWA pool does the same), both addressed through a
request-to-slot table, so the attention kernels see SGLang's paged layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_common import import_project  # noqa: E402

import_project()
from sglang_ext.kernel_select import use_triton  # noqa: E402
from sglang_ext.kernels.sink_attention import RopeKV  # noqa: E402
from sglang_ext.launch.make_tiny import OFFICIAL_20B_CONFIG  # noqa: E402
from sglang_ext.layers.fp8 import BLOCK  # noqa: E402
from sglang_ext.layers.lm_head import fp8_lm_head_logits, quantize_head_weight  # noqa: E402
from sglang_ext.layers.parallel import ParallelLayout, block_granular_ranges  # noqa: E402
from sglang_ext.layers.sink_attention import paged_sink_attention  # noqa: E402
from sglang_ext.models.gpt_oss_core import Collectives, GptOssDecoder, RankGroups  # noqa: E402


@dataclass(frozen=True)
class GptOssDims:
    name: str
    num_layers: int
    num_experts: int
    hidden: int = 2880
    intermediate: int = 2880
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    top_k: int = 4
    sliding_window: int = 128
    swiglu_limit: float = 7.0
    rms_eps: float = 1e-5
    probe_layers: tuple = ()

    def is_sliding(self, layer: int) -> bool:
        return layer % 2 == 0  # layer_types alternate, starting with sliding_attention

    def config(self) -> SimpleNamespace:
        """The Hugging Face config of these dims: the official gpt-oss config.json with the sizes replaced."""
        layer_types = ["sliding_attention" if self.is_sliding(i) else "full_attention" for i in range(self.num_layers)]
        return SimpleNamespace(**{
            **OFFICIAL_20B_CONFIG, "num_hidden_layers": self.num_layers, "num_local_experts": self.num_experts,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "num_experts_per_tok": self.top_k, "experts_per_token": self.top_k,
            "sliding_window": self.sliding_window, "swiglu_limit": self.swiglu_limit, "rms_norm_eps": self.rms_eps,
            "layer_types": layer_types})


GPT_OSS_120B = GptOssDims("gpt-oss-120b", 36, 128, probe_layers=(10, 22, 34))
GPT_OSS_20B = GptOssDims("gpt-oss-20b", 24, 32, probe_layers=(6, 14, 22))
# Smoke-test dims (CPU): two 128-blocks plus a ragged one, GQA 4, window 8; 256 q rows, so TP 2 cuts the
# heads on the 128-grid (the server refuses FP8 head shards that cut a block).
GPT_OSS_TINY = GptOssDims("gpt-oss-tiny", 4, 8, hidden=320, intermediate=256, num_heads=16, num_kv_heads=4,
                          head_dim=16, vocab=1000, sliding_window=8, probe_layers=(1, 2, 3))
MODELS = {"120b": GPT_OSS_120B, "20b": GPT_OSS_20B, "tiny": GPT_OSS_TINY}


def parallel_layout(tp: int = 1, ep: int = 1, dp: int = 1, rank: int = 0) -> ParallelLayout:
    """SGLang's --tp/--ep/--dp on one node for one rank (world = tp)."""
    if tp % ep or tp % dp:
        raise ValueError(f"ep ({ep}) and dp ({dp}) must divide tp ({tp}), as in SGLang")
    if 1 < dp < tp:
        raise ValueError("data-parallel attention here runs with dp == tp (attention weights replicated)")
    return ParallelLayout(tp_size=tp, tp_rank=rank, ep_size=ep, attn_dp_size=dp)


def layout_label(layout: ParallelLayout) -> str:
    return f"EP{layout.ep_size} DP{layout.attn_dp_size} TP{layout.tp_size}"


def _random_fp8(shape, device, gen) -> torch.Tensor:
    # Fresh random e4m3 values (never NaN: drawn in range, then cast), built in chunks so the
    # fp32 temporary stays small next to a nearly full GPU.
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
    step = max(1, (64 << 20) // max(1, flat.shape[1]))
    for i in range(0, flat.shape[0], step):
        chunk = torch.randn(flat[i:i + step].shape, device=device, generator=gen) * 64
        flat[i:i + step] = chunk.clamp(-448, 448).to(torch.float8_e4m3fn)
    return out


def expert_slice_width(intermediate: int, moe_tp: int, moe_tp_rank: int) -> int:
    lo, hi = block_granular_ranges(intermediate, moe_tp)[moe_tp_rank]
    return hi - lo


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


class HarnessCollectives(Collectives):
    """The decoder's collectives over one torch.distributed group (the whole world: TP; with DP attention,
    dp == tp, so each attention group is one rank). `group` None or `emulate`: one process, the identity."""

    def __init__(self, group, layout: ParallelLayout, emulate: bool):
        self.group = group if not emulate else None
        self.layout = layout

    def all_reduce(self, x):
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def attn_all_reduce(self, x):
        if self.layout.attn_tp_size == 1:
            return x
        return self.all_reduce(x)  # dp == 1: the attention group is the TP group

    def dp_gather(self, x, batch):
        if self.group is None:
            return x
        out = x.new_empty(dist.get_world_size(self.group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def dp_scatter(self, out, x, batch):
        if self.group is None:
            return out
        n = x.shape[0]
        return out[self.layout.attn_dp_rank * n:(self.layout.attn_dp_rank + 1) * n]


@dataclass
class HarnessBatch:
    """A forward's rows over the harness cache (what SGLang's ForwardBatch carries for the attention)."""

    seq_lens: torch.Tensor  # [B] keys after the write
    q_start: torch.Tensor  # [B]
    q_len: torch.Tensor  # [B]
    req_idx: torch.Tensor  # [B] rows of the request-to-slot tables
    out_full: torch.Tensor  # [T] slots of the full-attention layers
    out_swa: torch.Tensor  # [T] slots of the sliding layers' rings
    no_prefix: bool


class PagedAttention(nn.Module):
    """One layer's attention over the harness cache, called as SGLang's RadixAttention is (the attention op
    of gpt_oss_core.GptOssAttention): q [T, H, D] and k [T, Hkv, D] unrotated with `rope_cos_sin` on the kernel
    path (RoPE and the KV write in the attention's launches, as the ext_sinks backend does), else rotated and
    flattened; v [T, Hkv * D]. Returns [T, H * D]."""

    def __init__(self, step: "ModelStep", num_heads, head_dim, scaling, num_kv_heads, layer_id, sliding_window_size):
        super().__init__()
        self.step, self.layer_id = step, layer_id
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scaling, self.window = scaling, sliding_window_size

    @property
    def applies_rope_kv(self) -> bool:
        return use_triton(self.step.device)

    def forward(self, q, k, v, batch: HarnessBatch, sinks=None, rope_cos_sin=None):
        step, sliding = self.step, self.window >= 0
        tokens, hd = q.shape[0], self.head_dim
        k_buf, v_buf = step.kv_swa[self.layer_id] if sliding else step.kv_full[self.layer_id]
        loc = batch.out_swa if sliding else batch.out_full
        v = v.view(tokens, self.num_kv_heads, hd)
        if rope_cos_sin is not None:
            rope = RopeKV(k, v, rope_cos_sin, loc)
        else:
            rope = None
            q = q.view(tokens, self.num_heads, hd)
            k_buf[loc.long()] = k.view(tokens, self.num_kv_heads, hd)
            v_buf[loc.long()] = v
        o = paged_sink_attention(
            q, k_buf, v_buf, step.req_to_token_swa if sliding else step.req_to_token_full, batch.req_idx,
            batch.seq_lens, batch.q_start, batch.q_len, sinks, self.window, self.scaling, rope=rope,
            no_prefix=batch.no_prefix)
        return o.reshape(tokens, -1)


@contextlib.contextmanager
def _building(device, dtype):
    """Modules made on `device` with `dtype` as the default (as SGLang builds the model)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def _randomize(decoder: GptOssDecoder, gen: torch.Generator) -> None:
    """Random weights of the right scale for every parameter of the decoder (FP8 codes drawn in range)."""
    for layer in decoder.layers:
        attn, ex = layer.self_attn, layer.mlp.experts
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.weight.data = _random_fp8(tuple(lin.weight.shape), lin.weight.device, gen)
            lin.weight_scale_inv.data.copy_(torch.rand(lin.weight_scale_inv.shape, generator=gen,
                                                       device=gen.device) * 2e-4 + 1e-4)
            lin.bias.data.copy_(torch.randn(lin.bias.shape, generator=gen, device=gen.device) * 0.02)
        attn.sinks.data.copy_(torch.randn(attn.sinks.shape, generator=gen, device=gen.device))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.copy_(torch.rand(norm.weight.shape, generator=gen, device=gen.device) + 0.5)
        router = layer.mlp.router
        router.weight.data.copy_(torch.randn(router.weight.shape, generator=gen, device=gen.device) * 0.02)
        router.bias.data.copy_(torch.randn(router.bias.shape, generator=gen, device=gen.device) * 0.02)
        for name in ("gate_up_proj", "down_proj"):
            w, s = getattr(ex, name), getattr(ex, name + "_scale_inv")
            w.data = _random_fp8(tuple(w.shape), w.device, gen)
            s.data.copy_(torch.rand(s.shape, generator=gen, device=gen.device) * 2e-4 + 1e-4)
        for b in (ex.gate_up_proj_bias, ex.down_proj_bias):
            b.data.copy_(torch.randn(b.shape, generator=gen, device=gen.device) * 0.02)
        attn.fuse_qkv()


@dataclass
class ModelStep:
    """Rank-local gpt-oss with a paged KV cache for `batch` requests of up to `context` tokens."""

    dims: GptOssDims
    layout: ParallelLayout
    batch: int
    context: int
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    group: object = None  # torch.distributed group, None = single process
    emulate: bool = False  # rank 0 of a larger world in one process: collectives skipped
    seed: int = 0
    # Slots per request of the sliding layers: a ring of `sliding_window` for decode; a prefill
    # writes all its keys before attending, so it needs `context` (SGLang frees them after).
    swa_slots: int = 0
    # The LM head in e4m3 blocks, as a server with SGLANG_EXT_FP8_LM_HEAD=1 (sglang_ext/layers/lm_head.py)
    fp8_lm_head: bool = False

    def __post_init__(self):
        d, lay = self.dims, self.layout
        dev, dt = self.device, self.dtype
        if lay.attn_dp_size not in (1, lay.tp_size):
            raise ValueError("data-parallel attention here runs with dp == tp (attention weights replicated)")
        gen = torch.Generator(device=dev).manual_seed(self.seed * 1000 + lay.tp_rank)
        groups = RankGroups(lay, HarnessCollectives(self.group, lay, self.emulate))
        step = self

        def attention(*args, **kwargs):
            return PagedAttention(step, *args, **kwargs)

        with _building(dev, dt):
            self.decoder = GptOssDecoder(d.config(), groups, fp8=True, attention=attention)
        _randomize(self.decoder, gen)
        attn0 = self.decoder.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        vocab_local = -(-d.vocab // lay.attn_tp_size)
        self.embed = (torch.randn(vocab_local, d.hidden, device=dev, generator=gen) * 0.02).to(dt)
        self.lm_head = (torch.randn(vocab_local, d.hidden, device=dev, generator=gen) * 0.02).to(dt)
        self.lm_head_fp8 = None
        if self.fp8_lm_head:  # the e4m3 head only, as a server holds it (the bf16 one would be 1.16 GB unused)
            self.lm_head_fp8, self.lm_head = quantize_head_weight(self.lm_head), None
        self.probe = None
        self.allocate_cache(self.batch, self.context, self.swa_slots)

    @property
    def layers(self):
        return self.decoder.layers

    def allocate_cache(self, batch: int, context: int, swa_slots: int = 0):
        """(Re)allocate the paged KV for `batch` requests of up to `context` tokens; weights stay."""
        d, dev, dt, hd = self.dims, self.device, self.dtype, self.dims.head_dim
        self.kv_full = self.kv_swa = self.req_to_token_full = self.req_to_token_swa = None
        if dev == "cuda" or (isinstance(dev, torch.device) and dev.type == "cuda"):
            torch.cuda.empty_cache()
        self.batch, self.context, self.swa_slots = batch, context, swa_slots
        self.batch_local = batch if self.layout.attn_dp_size == 1 else -(-batch // self.layout.attn_dp_size)
        b = self.batch_local
        gen = torch.Generator(device=dev).manual_seed(self.seed * 1000 + 7)
        # Paged KV: slot 0 is a scratch slot (SGLang reserves one too). Random contents: the
        # attention reads real-looking keys; their values do not matter for timing.
        kv_shape = lambda n: (n, self.num_kv_heads, hd)  # noqa: E731

        def kv(n):
            return (torch.empty(kv_shape(n), device=dev, dtype=dt).normal_(generator=gen),
                    torch.empty(kv_shape(n), device=dev, dtype=dt).normal_(generator=gen))

        ring = swa_slots or d.sliding_window
        self.kv_full = [None if d.is_sliding(i) else kv(1 + b * context) for i in range(d.num_layers)]
        self.kv_swa = [kv(1 + b * ring) if d.is_sliding(i) else None for i in range(d.num_layers)]
        pos = torch.arange(context, device=dev, dtype=torch.int32)
        req = torch.arange(b, device=dev, dtype=torch.int32)[:, None]
        self.req_to_token_full = 1 + req * context + pos[None, :]
        self.req_to_token_swa = 1 + req * ring + pos[None, :] % ring
        if self.probe is not None:
            self.probe.allocate()

    # -- sizes ----------------------------------------------------------------------
    @staticmethod
    def bytes_needed(dims: GptOssDims, layout: ParallelLayout, batch: int, context: int, swa_slots: int = 0) -> dict:
        """Bytes this rank allocates (weights, KV), computed before allocating anything."""
        d = dims
        heads, kv_heads = d.num_heads // layout.attn_tp_size, d.num_kv_heads // layout.attn_tp_size
        inter = expert_slice_width(d.intermediate, layout.moe_tp_size, layout.moe_tp_rank)
        experts = d.num_experts // layout.ep_size
        attn = d.hidden * (heads + 2 * kv_heads) * d.head_dim + heads * d.head_dim * d.hidden
        expert_bytes = experts * (2 * inter * d.hidden + d.hidden * inter)
        weights = d.num_layers * (attn + expert_bytes + 2 * d.num_experts * d.hidden)
        weights += 2 * 2 * (-(-d.vocab // layout.attn_tp_size)) * d.hidden
        b = batch if layout.attn_dp_size == 1 else -(-batch // layout.attn_dp_size)
        per_slot = 2 * kv_heads * d.head_dim * 2
        full_layers = sum(not d.is_sliding(i) for i in range(d.num_layers))
        kv = full_layers * b * context * per_slot + (d.num_layers - full_layers) * b * (swa_slots or d.sliding_window) * per_slot
        return {"weights": weights, "kv": kv, "total": weights + kv}

    # -- the forward --------------------------------------------------------------------
    def forward(self, token_ids, positions, seq_lens, q_start, q_len, out_full, out_swa, no_prefix=False):
        """One forward over the flattened query rows of `batch_local` requests.

        token_ids/positions/out_* : [T]; seq_lens, q_start, q_len: [B] (keys after the write).
        no_prefix: no request has cached keys before its rows (a prefill: every layer's attention reads
        this forward's keys as rows, as a server's prefill does). Returns the logits of each request's last
        row, [B, vocab_local].
        """
        h = F.embedding(token_ids.clamp_max(self.embed.shape[0] - 1), self.embed)
        req_idx = torch.arange(seq_lens.shape[0], device=h.device, dtype=torch.int32)
        last = q_start + q_len - 1
        batch = HarnessBatch(seq_lens, q_start, q_len, req_idx, out_full, out_swa, no_prefix)
        if self.probe is not None:
            self.probe.expect(out_full, seq_lens, last)
        x = self.decoder.decode(h, positions, batch, self.probe.runtime if self.probe is not None else None)
        x = x[last.long()]
        carveout = (head_carveout(self.probe.head_carveout, self.probe.head_carveout_lt) if self.probe is not None
                    else contextlib.nullcontext())
        with carveout:
            logits = fp8_lm_head_logits(x, *self.lm_head_fp8) if self.fp8_lm_head else F.linear(x, self.lm_head)
        if self.probe is not None:
            self.probe.step(out_full, seq_lens, last)
        return logits

    # -- inputs -----------------------------------------------------------------------------
    def decode_inputs(self, context_len: int):
        """Static decode inputs: each request at position context_len - 1 (its last slot)."""
        b, dev = self.batch_local, self.device
        pos = torch.full((b,), context_len - 1, device=dev, dtype=torch.int64)
        req = torch.arange(b, device=dev)
        return dict(
            token_ids=torch.randint(0, self.dims.vocab, (b,), device=dev),
            positions=pos,
            seq_lens=torch.full((b,), context_len, device=dev, dtype=torch.int32),
            q_start=torch.arange(b, device=dev, dtype=torch.int32),
            q_len=torch.ones(b, device=dev, dtype=torch.int32),
            out_full=self.req_to_token_full[req, pos],
            out_swa=self.req_to_token_swa[req, pos],
        )

    def prefill_inputs(self, length: int):
        """One request (request 0) of `length` new tokens, no cached prefix."""
        dev = self.device
        pos = torch.arange(length, device=dev, dtype=torch.int64)
        return dict(
            token_ids=torch.randint(0, self.dims.vocab, (length,), device=dev),
            positions=pos,
            seq_lens=torch.tensor([length], device=dev, dtype=torch.int32),
            q_start=torch.zeros(1, device=dev, dtype=torch.int32),
            q_len=torch.tensor([length], device=dev, dtype=torch.int32),
            out_full=self.req_to_token_full[0, :length],
            out_swa=self.req_to_token_swa[0, :length],
            no_prefix=True,
        )


@contextlib.contextmanager
def head_carveout(sms: int, lt: bool = False):
    """The LM head's GEMM launched with `sms` SMs left free (torch's SM carveout), so the probe's step on its
    side stream need not wait for the head to drain. cuBLAS ignores the carveout and cuBLASLt honours it
    (`lt`: the head through cuBLASLt). An experiment of the harness (paired probe-off/on graphs with the
    carveout set), not adopted: with the probe on, the head would run another
    GEMM kernel than with it off."""
    if not sms:
        yield
        return
    before, library = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(sms)
    if lt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(library)


class HarnessProbe:
    """SingProbe on the harness's cache: the serving runtime itself (`ProbeRuntime`, the code a
    server runs: taps -> RMS-normalised features -> one q|k|v GEMM -> K|V into a pool indexed by
    the base model's full-attention slots -> windowed MQA -> fused tail) on random weights."""

    def __init__(self, model: "ModelStep", window: int = 2048):
        from sglang_ext.probe.config import ProbeConfig
        from sglang_ext.probe.model import SingProbeHead
        from sglang_ext.probe_runtime import ProbeRuntime

        d = model.dims
        cfg = ProbeConfig.from_dict({
            "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": d.hidden,
            "base_model_layer_ids": list(d.probe_layers), "num_attention_heads": 8, "head_dim": 64,
            "sliding_window": window, "num_labels": 10, "base_model_name": f"openai/{d.name}",
            "torch_dtype": "bfloat16"})
        head = SingProbeHead(cfg)
        for p in head.parameters():
            p.data.normal_(0, 0.02)
        head.norm.weight.data.fill_(1.0)
        self.runtime = ProbeRuntime.from_weights(cfg, head.state_dict(), model.dtype, model.device)
        self.cfg = cfg
        self.model = model
        self.scores = None
        self.head_carveout, self.head_carveout_lt = 0, False  # head_carveout()'s arguments
        self._request_rows: dict = {}
        self.allocate()

    @property
    def head(self):
        return self.runtime.head

    def allocate(self):
        full = next(kv for kv in self.model.kv_full if kv is not None)
        self.runtime.bind(self.model.req_to_token_full, full[0].shape[0])

    def _batch(self, out_full: torch.Tensor, seq_lens: torch.Tensor, last_rows: torch.Tensor):
        # Request rows 0..B-1, made once (a capture's warm-up runs first): a server passes its batch's own
        # req_pool_indices, so an arange launched here at the step's start and end would be ~2-3 us that the
        # harness, not the probe, adds to the probe-on step.
        n = seq_lens.shape[0]
        req = self._request_rows.get(n)
        if req is None or req.device != seq_lens.device:
            req = torch.arange(n, device=seq_lens.device)
            # made inside a capture, it holds its values only once the graph replays: used there, not kept
            if not (req.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._request_rows[n] = req
        decode = out_full.shape[0] == seq_lens.shape[0]  # one row per request: each row samples
        return out_full, req, seq_lens, None if decode else last_rows

    def expect(self, out_full: torch.Tensor, seq_lens: torch.Tensor, last_rows: torch.Tensor):
        self.runtime.expect_batch(*self._batch(out_full, seq_lens, last_rows))

    def step(self, out_full: torch.Tensor, seq_lens: torch.Tensor, last_rows: torch.Tensor):
        self.scores = self.runtime.finish(*self._batch(out_full, seq_lens, last_rows))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of experts a decode step touches under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def decode_step_bytes(dims: GptOssDims, layout: ParallelLayout, batch: int, context: int,
                      fp8_lm_head: bool = False) -> float:
    """Bytes one rank must read in a decode step (weights touched + KV): the bandwidth floor
    (`fp8_lm_head`: the head's e4m3 codes and fp32 block scales instead of its bf16)."""
    lay, d = layout, dims
    heads, kv_heads = d.num_heads // lay.attn_tp_size, d.num_kv_heads // lay.attn_tp_size
    b = batch if lay.attn_dp_size == 1 else -(-batch // lay.attn_dp_size)
    moe_tokens = batch if lay.attn_dp_size > 1 else b
    inter = expert_slice_width(d.intermediate, lay.moe_tp_size, lay.moe_tp_rank)
    local = d.num_experts // lay.ep_size
    touched = expected_distinct_experts(d.num_experts, d.top_k, moe_tokens) * local / d.num_experts
    attn = d.hidden * (heads + 2 * kv_heads) * d.head_dim + heads * d.head_dim * d.hidden
    per_layer = attn + touched * 3 * inter * d.hidden + 2 * d.num_experts * d.hidden
    per_slot = 2 * kv_heads * d.head_dim * 2
    kv = 0
    for i in range(d.num_layers):
        kv += b * (min(context, d.sliding_window) if d.is_sliding(i) else context) * per_slot
    vocab_local = -(-d.vocab // lay.attn_tp_size)
    lm_head = 2 * vocab_local * d.hidden
    if fp8_lm_head:
        lm_head = vocab_local * d.hidden + 4 * _blocks(vocab_local) * _blocks(d.hidden)
    return d.num_layers * per_layer + kv + lm_head


def prefill_flops(dims: GptOssDims, length: int) -> float:
    """FLOPs of a whole-model prefill of `length` tokens (all ranks together)."""
    d = dims
    attn_lin = d.hidden * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim * d.hidden
    moe = d.top_k * 3 * d.intermediate * d.hidden
    flops = 2 * length * d.num_layers * (attn_lin + moe) + 2 * d.hidden * d.vocab
    for i in range(d.num_layers):
        keys = min(d.sliding_window, length) if d.is_sliding(i) else (length + 1) / 2
        flops += 2 * 2 * length * keys * d.num_heads * d.head_dim
    return flops


__all__ = ["GPT_OSS_120B", "GPT_OSS_20B", "MODELS", "GptOssDims", "ModelStep", "layout_label", "parallel_layout",
           "decode_step_bytes", "expected_distinct_experts", "prefill_flops"]
