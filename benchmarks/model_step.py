"""The model-step harness: gpt-oss at full size with random FP8 weights, on 1..N GPUs.

It runs the project's own SGLang-free modules (sglang_ext.layers: FP8 linear with bias,
MoE, RoPE, RMSNorm; sglang_ext.kernels: the Triton kernels behind them) wired to a
minimal paged KV cache instead of SGLang's, because the GPU image has no SGLang. The
maths per layer is the SGLang model's (sglang_ext/models/gpt_oss.py): norm -> q|k|v
(FP8, bias) -> RoPE -> KV write -> attention with sinks (window 128 on even layers) ->
o_proj (FP8, bias once after the TP all-reduce) -> residual -> norm -> router (bf16,
softmax over top-4) -> experts (FP8, biases; mlp2's bias once) -> all-reduce -> residual.

Parallelism follows SGLang's --tp/--ep/--dp (world = tp): attention heads split over
tp // dp ranks (dp > 1 is data-parallel attention: each DP group runs its own requests);
experts split into `ep` contiguous ranges, each expert's intermediate dimension over
tp // ep ranks cut on the 128-block grid (sglang_ext.layers.parallel.block_granular_ranges:
2880 at moe-TP 4 -> 768/768/768/576; rank 0, the busiest, is the one timed when modelled). Collectives are torch.distributed (NCCL on GPUs, gloo on CPU for the
tests). Under `emulate_world`, a single process builds rank 0's shard of a larger
configuration and the collectives are replaced by modelled times (perf_model.py): the
"modelled" rows of bench_decode / bench_prefill.

KV cache: full-attention layers own `batch * context` slots; sliding layers a ring of 128
slots per request (SGLang's SWA pool does the same), both addressed through a
request-to-slot table, so the attention kernels see SGLang's paged layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.bench_common import import_project  # noqa: E402

import_project()
from sglang_ext.layers.fp8 import BLOCK  # noqa: E402
from sglang_ext.layers.parallel import block_granular_ranges  # noqa: E402
from sglang_ext.layers.linear import Linear  # noqa: E402
from sglang_ext.layers.lm_head import fp8_lm_head_logits, quantize_head_weight  # noqa: E402
from sglang_ext.layers.moe import moe_forward  # noqa: E402
from sglang_ext.layers.norm import residual_rms_norm, rms_norm  # noqa: E402
from sglang_ext.layers.rope import YarnRope, apply_rope  # noqa: E402
from sglang_ext.layers.sink_attention import paged_sink_attention  # noqa: E402
from sglang_ext.kernel_select import use_triton  # noqa: E402
from sglang_ext.kernels.sink_attention import RopeKV  # noqa: E402


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


GPT_OSS_120B = GptOssDims("gpt-oss-120b", 36, 128, probe_layers=(10, 22, 34))
GPT_OSS_20B = GptOssDims("gpt-oss-20b", 24, 32, probe_layers=(6, 14, 22))
# Smoke-test dims (CPU): two 128-blocks plus a ragged one, GQA 4, window 8.
GPT_OSS_TINY = GptOssDims("gpt-oss-tiny", 4, 8, hidden=320, intermediate=256, num_heads=8, num_kv_heads=2,
                          head_dim=16, vocab=1000, sliding_window=8, probe_layers=(1, 2, 3))
MODELS = {"120b": GPT_OSS_120B, "20b": GPT_OSS_20B, "tiny": GPT_OSS_TINY}


@dataclass(frozen=True)
class Sharding:
    """SGLang's --tp/--ep/--dp on one node for one rank (world = tp)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    rank: int = 0

    def __post_init__(self):
        if self.tp % self.ep or self.tp % self.dp:
            raise ValueError(f"ep ({self.ep}) and dp ({self.dp}) must divide tp ({self.tp}), as in SGLang")
        if 1 < self.dp < self.tp:
            raise ValueError("data-parallel attention here runs with dp == tp (attention weights replicated)")

    @property
    def label(self) -> str:
        return f"EP{self.ep} DP{self.dp} TP{self.tp}"

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def attn_rank(self) -> int:
        return self.rank % self.attn_tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp


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


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = x.new_empty(x.shape[0] // world, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


@dataclass
class LayerWeights:
    qkv: Linear
    o: Linear
    sinks: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    router_weight: torch.Tensor
    router_bias: torch.Tensor
    w1: torch.Tensor
    w1_scale_inv: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    w2_scale_inv: torch.Tensor
    b2: torch.Tensor


def _fp8_linear(in_f, out_f, device, dtype, gen) -> Linear:
    lin = Linear(in_f, out_f, bias=True, dtype=dtype, fp8=True).to(device)
    lin.weight.data = _random_fp8((out_f, in_f), device, gen)
    lin.weight_scale_inv.data = torch.rand(_blocks(out_f), _blocks(in_f), device=device, generator=gen) * 2e-4 + 1e-4
    lin.bias.data = torch.randn(out_f, device=device, generator=gen).to(dtype) * 0.02
    return lin


@dataclass
class ModelStep:
    """Rank-local gpt-oss with a paged KV cache for `batch` requests of up to `context` tokens."""

    dims: GptOssDims
    sharding: Sharding
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
    layers: list = field(default_factory=list)

    def __post_init__(self):
        d, s = self.dims, self.sharding
        dev, dt = self.device, self.dtype
        gen = torch.Generator(device=dev).manual_seed(self.seed * 1000 + s.rank)
        if d.num_heads % s.attn_tp or d.num_kv_heads % s.attn_tp:
            raise ValueError(f"{d.num_kv_heads} KV heads do not split over attention TP {s.attn_tp}")
        if d.num_experts % s.ep:
            raise ValueError(f"{d.num_experts} experts do not split over EP {s.ep}")
        self.num_heads = d.num_heads // s.attn_tp
        self.num_kv_heads = d.num_kv_heads // s.attn_tp
        self.local_experts = d.num_experts // s.ep
        self.expert_offset = s.ep_rank * self.local_experts
        self.inter_local = expert_slice_width(d.intermediate, s.moe_tp, s.moe_tp_rank)
        hd = d.head_dim
        self.rope = YarnRope(head_dim=hd)
        self.cos_sin = self.rope.cos_sin_cache(self.context + 1, device=dev)
        for layer in range(d.num_layers):
            w1_rows = 2 * self.inter_local
            self.layers.append(LayerWeights(
                qkv=_fp8_linear(d.hidden, (self.num_heads + 2 * self.num_kv_heads) * hd, dev, dt, gen),
                o=_fp8_linear(self.num_heads * hd, d.hidden, dev, dt, gen),
                sinks=torch.randn(self.num_heads, device=dev, generator=gen),
                input_norm=torch.rand(d.hidden, device=dev, generator=gen).to(dt) + 0.5,
                post_norm=torch.rand(d.hidden, device=dev, generator=gen).to(dt) + 0.5,
                router_weight=(torch.randn(d.num_experts, d.hidden, device=dev, generator=gen) * 0.02).to(dt),
                router_bias=(torch.randn(d.num_experts, device=dev, generator=gen) * 0.02).to(dt),
                w1=_random_fp8((self.local_experts, w1_rows, d.hidden), dev, gen),
                w1_scale_inv=torch.rand(self.local_experts, _blocks(w1_rows), _blocks(d.hidden), device=dev,
                                        generator=gen) * 2e-4 + 1e-4,
                b1=(torch.randn(self.local_experts, w1_rows, device=dev, generator=gen) * 0.02).to(dt),
                w2=_random_fp8((self.local_experts, d.hidden, self.inter_local), dev, gen),
                w2_scale_inv=torch.rand(self.local_experts, _blocks(d.hidden), _blocks(self.inter_local),
                                        device=dev, generator=gen) * 2e-4 + 1e-4,
                b2=(torch.randn(self.local_experts, d.hidden, device=dev, generator=gen) * 0.02).to(dt),
            ))
        vocab_local = -(-d.vocab // s.attn_tp)
        self.embed = (torch.randn(vocab_local, d.hidden, device=dev, generator=gen) * 0.02).to(dt)
        self.lm_head = (torch.randn(vocab_local, d.hidden, device=dev, generator=gen) * 0.02).to(dt)
        self.lm_head_fp8 = None
        if self.fp8_lm_head:  # the e4m3 head only, as a server holds it (the bf16 one would be 1.16 GB unused)
            self.lm_head_fp8, self.lm_head = quantize_head_weight(self.lm_head), None
        self.final_norm = torch.ones(d.hidden, device=dev, dtype=dt)
        self.probe = None
        self.allocate_cache(self.batch, self.context, self.swa_slots)

    def allocate_cache(self, batch: int, context: int, swa_slots: int = 0):
        """(Re)allocate the paged KV for `batch` requests of up to `context` tokens; weights stay."""
        d, dev, dt, hd = self.dims, self.device, self.dtype, self.dims.head_dim
        self.kv_full = self.kv_swa = self.req_to_token_full = self.req_to_token_swa = None
        if dev == "cuda" or (isinstance(dev, torch.device) and dev.type == "cuda"):
            torch.cuda.empty_cache()
        self.batch, self.context, self.swa_slots = batch, context, swa_slots
        self.batch_local = batch if self.sharding.dp == 1 else -(-batch // self.sharding.dp)
        b = self.batch_local
        gen = torch.Generator(device=dev).manual_seed(self.seed * 1000 + 7)
        if self.cos_sin.shape[0] < context + 1:
            self.cos_sin = self.rope.cos_sin_cache(context + 1, device=dev)
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
    def bytes_needed(dims: GptOssDims, sharding: Sharding, batch: int, context: int, swa_slots: int = 0) -> dict:
        """Bytes this rank allocates (weights, KV), computed before allocating anything."""
        s, d = sharding, dims
        heads, kv_heads = d.num_heads // s.attn_tp, d.num_kv_heads // s.attn_tp
        inter = expert_slice_width(d.intermediate, s.moe_tp, s.moe_tp_rank)
        experts = d.num_experts // s.ep
        attn = d.hidden * (heads + 2 * kv_heads) * d.head_dim + heads * d.head_dim * d.hidden
        expert_bytes = experts * (2 * inter * d.hidden + d.hidden * inter)
        weights = d.num_layers * (attn + expert_bytes + 2 * d.num_experts * d.hidden)
        weights += 2 * 2 * (-(-d.vocab // s.attn_tp)) * d.hidden
        b = batch if s.dp == 1 else -(-batch // s.dp)
        per_slot = 2 * kv_heads * d.head_dim * 2
        full_layers = sum(not d.is_sliding(i) for i in range(d.num_layers))
        kv = full_layers * b * context * per_slot + (d.num_layers - full_layers) * b * (swa_slots or d.sliding_window) * per_slot
        return {"weights": weights, "kv": kv, "total": weights + kv}

    # -- collectives ------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None and not self.emulate:
            dist.all_reduce(x, group=self.group)
        return x

    # -- the forward --------------------------------------------------------------------
    def forward(self, token_ids, positions, seq_lens, q_start, q_len, out_full, out_swa, no_prefix=False):
        """One forward over the flattened query rows of `batch_local` requests.

        token_ids/positions/out_* : [T]; seq_lens, q_start, q_len: [B] (keys after the write).
        no_prefix: no request has cached keys before its rows (a prefill: every layer's attention reads
        this forward's keys as rows, as a server's prefill does). Returns the logits of each request's last
        row, [B, vocab_local].
        """
        d, s = self.dims, self.sharding
        hd = d.head_dim
        h = F.embedding(token_ids.clamp_max(self.embed.shape[0] - 1), self.embed)
        cos_sin = self.cos_sin[positions.long()]
        req_idx = torch.arange(seq_lens.shape[0], device=h.device, dtype=torch.int32)
        tokens = h.shape[0]
        last = q_start + q_len - 1
        if self.probe is not None:
            self.probe.expect(out_full, seq_lens, last)
            self.probe.begin(tokens)
        pending = None  # the previous layer's MoE output, added inside this layer's first norm
        quantize = use_triton(h.device)  # the qkv projections are FP8
        for i, lw in enumerate(self.layers):
            # The server's order (models/gpt_oss.py): residual add + norm (+ the probe's tap) in one launch.
            tap = self.probe.tap_target(i) if self.probe is not None else None
            # Kernel path: the norm's launch also quantises x for the qkv GEMM (as the server).
            normed = residual_rms_norm(h, pending, lw.input_norm, d.rms_eps, tap, quantize=quantize)
            h, x = normed[:2]
            qkv = lw.qkv(x, x_quant=normed[2] if quantize else None)
            q = qkv[:, : self.num_heads * hd].view(tokens, self.num_heads, hd)
            k = qkv[:, self.num_heads * hd: (self.num_heads + self.num_kv_heads) * hd].view(tokens, self.num_kv_heads, hd)
            v = qkv[:, (self.num_heads + self.num_kv_heads) * hd:].view(tokens, self.num_kv_heads, hd)
            sliding = d.is_sliding(i)
            k_buf, v_buf = self.kv_swa[i] if sliding else self.kv_full[i]
            loc = out_swa if sliding else out_full
            rope = None
            if use_triton(h.device):
                # As the server: both RoPEs and the cache write in one launch (rope_store_kv), or, at
                # decode where the attention runs one-shot, inside the attention's launch.
                rope = RopeKV(k, v, cos_sin, loc)
            else:
                q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
                k_buf[loc.long()] = k
                v_buf[loc.long()] = v
            o = paged_sink_attention(
                q, k_buf, v_buf, self.req_to_token_swa if sliding else self.req_to_token_full, req_idx,
                seq_lens, q_start, q_len, lw.sinks, d.sliding_window - 1 if sliding else -1, hd ** -0.5,
                rope=rope, no_prefix=no_prefix)
            o = lw.o(o.reshape(tokens, -1), with_bias=s.attn_tp == 1)
            if s.attn_tp > 1:
                o = self._all_reduce(o) + lw.o.bias
            h, x = residual_rms_norm(h, o, lw.post_norm, d.rms_eps)
            pending = self._moe(x, lw)
        if self.probe is not None:
            self.probe.runtime.layers_done()
        h = h + pending
        x = rms_norm(h[last.long()], self.final_norm, d.rms_eps)
        carveout = (head_carveout(self.probe.head_carveout, self.probe.head_carveout_lt) if self.probe is not None
                    else contextlib.nullcontext())
        with carveout:
            logits = fp8_lm_head_logits(x, *self.lm_head_fp8) if self.fp8_lm_head else F.linear(x, self.lm_head)
        if self.probe is not None:
            self.probe.step(out_full, seq_lens, last)
        return logits

    def _moe(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        d, s = self.dims, self.sharding
        sharded = s.tp > 1 and not self.emulate
        if s.dp > 1 and sharded:
            # Data-parallel attention: the MoE runs over every DP group's tokens.
            x = _all_gather_rows(x, self.group)
        partial = moe_forward(
            x, lw.router_weight, lw.router_bias, lw.w1, lw.w1_scale_inv, lw.b1, lw.w2, lw.w2_scale_inv,
            lw.b2, top_k=d.top_k, limit=d.swiglu_limit, expert_offset=self.expert_offset,
            # mlp2's bias once per (token, expert): on the rank holding the expert's first slice.
            with_down_bias=s.moe_tp_rank == 0)
        if s.tp == 1:
            return partial
        if sharded:
            if s.dp > 1:
                return _reduce_scatter_rows(partial, self.group)
            dist.all_reduce(partial, group=self.group)
        return partial

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

    def begin(self, tokens: int):
        self.runtime.begin(tokens, self.model.device)

    def tap_target(self, layer: int):
        return self.runtime.tap_target(layer)

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


def decode_step_bytes(dims: GptOssDims, sharding: Sharding, batch: int, context: int,
                      fp8_lm_head: bool = False) -> float:
    """Bytes one rank must read in a decode step (weights touched + KV): the bandwidth floor
    (`fp8_lm_head`: the head's e4m3 codes and fp32 block scales instead of its bf16)."""
    s, d = sharding, dims
    heads, kv_heads = d.num_heads // s.attn_tp, d.num_kv_heads // s.attn_tp
    b = batch if s.dp == 1 else -(-batch // s.dp)
    moe_tokens = batch if s.dp > 1 else b
    inter = expert_slice_width(d.intermediate, s.moe_tp, s.moe_tp_rank)
    local = d.num_experts // s.ep
    touched = expected_distinct_experts(d.num_experts, d.top_k, moe_tokens) * local / d.num_experts
    attn = d.hidden * (heads + 2 * kv_heads) * d.head_dim + heads * d.head_dim * d.hidden
    per_layer = attn + touched * 3 * inter * d.hidden + 2 * d.num_experts * d.hidden
    per_slot = 2 * kv_heads * d.head_dim * 2
    kv = 0
    for i in range(d.num_layers):
        kv += b * (min(context, d.sliding_window) if d.is_sliding(i) else context) * per_slot
    vocab_local = -(-d.vocab // s.attn_tp)
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


__all__ = ["GPT_OSS_120B", "GPT_OSS_20B", "MODELS", "GptOssDims", "ModelStep", "Sharding",
           "decode_step_bytes", "expected_distinct_experts", "prefill_flops"]
