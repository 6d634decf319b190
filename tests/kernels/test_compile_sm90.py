"""Every shipped Triton kernel, in every launch configuration the served model reaches, compiles for sm_90a
with the installed Triton (the version SGLang pins), on a CPU: an API change between the Triton of the GPU image
and the pinned one fails here, in CI, not first on the H200.

Two driver processes (this file run as a script, each with a fresh TRITON_CACHE_DIR, so every kernel really
compiles) tell torch it has an H200 and give Triton a driver that compiles for GPUTarget("cuda", 90, 32), which
the CUDA backend builds as sm_90a (wgmma, TMA), PTX then cubin through Triton's bundled ptxas, and never launches
(benchmarks/compile_only.py). The operands are meta tensors (shape, dtype and strides, no memory): full-size
weights cost nothing, nothing can read a value on the host, and the launchers take their GPU branches (they ask
for "cpu" where they pick the interpreter's forms); where a launcher asks for "cuda" by name (PDL, TMA, SM counts:
DEVICE_QUESTIONS) it gets cuda:0's answer. Every launcher the model calls then runs through the served shapes:
gpt-oss-20b / 120b (hidden 2880, 64 q / 8 kv heads of 64, 32 / 128 experts top-4, intermediate 2880) at TP 1..8
and EP shards, decode batches 1..256 (PDL on and off; RoPE and the KV write fused into the decode attention and
not), prefill lengths up to 8192, contexts 4k..128k, full and sliding layers (the SWA pool's slot map too), the
opt-in FP8 LM head, the SingProbe at 3 taps of 2880; then, once each, the few shipped kernels and helpers no
served row compiles (_drive_alternatives). A launch whose configuration (kernel, constexprs, launch options,
argument dtypes) was compiled already is skipped: the sweep visits every batch size, but compiles each
configuration once, in one of the two processes. By default it compiles one configuration of each class: a kernel
with one set of flag constexprs (booleans, strings), launch options and argument types, whatever its tile sizes and
row counts (the first launch of the class in the sweep; plus the first of each GPU_REGIMES entry), about half the
configurations and every code path the flags choose. SGLANG_EXT_TEST_COMPILE_ALL=1 compiles every configuration
(~5 min on two cores; run it when a tile table changes).

Asserted: no launch raised; every launcher reached a kernel, and each configuration it reached is compiled or of a
compiled class; every compiled configuration has a non-empty cubin from PTX
whose `.target` is sm_90a, with griddepcontrol where it waits for PDL and TMA copies where it takes descriptors;
every `@triton.jit` function of the shipped kernel modules was code-generated into a compiled kernel; no configuration of the sweep is an interpreter-only form; and the GPU-only regimes
(GPU_REGIMES) are among the compiled configurations.

To check another Triton (e.g. the GPU image's 3.6), put it first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Constexprs that only the interpreter's forms set (TRITON_INTERPRET, CPU tensors): a compiled configuration
# carrying one of them True means a launcher took its CPU branch.
INTERPRETER_ONLY_FLAGS = ("DOT_FP32", "TORCH_CPU_SOFTMAX", "ROUND_BF16")
# Launcher names of the driver's extra launches: shipped forms the served tables do not pick, and (to compile the
# helpers only they call) the interpreter's forms
INTERPRETER_FORMS = "interpreter form"
ALTERNATIVES = ("alternative", INTERPRETER_FORMS)
# Hopper instructions looked for in each kernel's PTX: warpgroup MMAs, TMA copies, PDL's grid dependency control
PTX_MARKERS = ("wgmma.mma_async", "cp.async.bulk.tensor", "griddepcontrol")

# Every place a shipped kernel module asks what kind of device it runs on (`x.type == "cuda"`, `.is_cuda`, ...),
# by (module, function), and how the meta tensors of the sweep get an H200's answer there. A new question fails
# test_device_questions_are_answered until it is listed (and, if it asks for "cuda", answered in
# _fake_h200_device_answers), so the sweep cannot silently take a CPU branch.
DEVICE_QUESTIONS = {
    ("pdl", "pdl_enabled"): "answered for cuda:0",
    ("tma", "tma_supported"): "answered for cuda:0",
    ("_util", "num_sms"): "answered for cuda:0",
    ("probe_attention", "auto_num_splits"): "answered for cuda:0",
    ("arrival_counters", "arrival_counters"): "meta: never inside a CUDA-graph capture",
    ("moe.routing", "_front"): "asks for 'cpu' (the interpreter's softmax): meta is not",
    ("moe.routing", "_decode_front"): "asks for 'cpu' (the interpreter's tiling and softmax): meta is not",
    ("moe.gemv", "_experts_gemv"): "asks for 'cpu' (the interpreter's fp32 dots): meta is not",
    ("moe.dispatch", "_experts"): "asks for 'cpu' (the interpreter's tiles and fp32 dots): meta is not",
}

# Regimes that only a launcher on an H200 picks: (kernel, constexprs / launch options that must all match
# one compiled configuration). Each one proves a device answer reached the launchers.
GPU_REGIMES = [
    ("_fp8_gemm_tma_kernel", {"BLOCK_M": 128, "num_warps": 8}),  # prefill >= 1025 rows, TMA tiles
    ("_fp8_gemm_tma_kernel", {"BLOCK_M": 64, "num_stages": 3}),  # 257..1024 rows
    ("_fp8_gemm_kernel", {"SPLIT_K": True}),  # 17..64 rows of o: split-K pointer tiles
    ("_fp8_gemv_oneshot_kernel", {"USE_PDL": True, "launch_pdl": True}),  # batch 1, a programmatic dependent
    ("_fp8_gemv_oneshot_kernel", {"USE_PDL": False}),  # PDL off (a GPU before sm90, set_pdl(False))
    ("_fp8_gemv_kernel_xonce", {"USE_PDL": True}),
    ("_fp8_gemv_kernel", {"USE_PDL": True, "launch_pdl": False}),  # PDL_PLAIN_FROM_ROWS: waits, starts plainly
    ("_decode_front_kernel", {"ROW_LOOP": True}),
    ("_front_kernel", {"ALIGN": True}),  # the fused sort (<= 64 tokens on >= 64 experts)
    ("_mlp1_kernel", {"TMA": True, "X_TMA": True}),  # prefill row, x gathered
    ("_mlp1_kernel", {"TMA": True, "X_TMA": False}),  # 9..128 tokens, x by pointers
    ("_mlp2_kernel", {"TMA": True}),
    ("_mlp1_oneshot_kernel", {"USE_PDL": True}),
    ("_mlp1_gemv_kernel", {"DOT_FP32": False}),  # tensor-core slabs, not the interpreter's fp32 sums
    ("_sink_decode_oneshot_kernel", {"ROPE": True, "USE_PDL": True}),  # RoPE + KV write in the decode
    ("_sink_decode_kernel", {"ROPE": True}),
    ("_sink_decode_kernel", {"HAS_SLOT_MAP": True}),  # the hybrid SWA pool's sliding layers
    ("_sink_prefill_kernel", {"WINDOW": True}),
    ("_sink_prefill_kernel", {"WINDOW": False}),
    ("_sink_extend_window_kernel", {"DOTS_16BIT": True}),
    ("_residual_rms_norm_kernel", {"QUANTIZE": True, "HAS_TAP": True, "HW_ROUND": True}),
    ("_attn_split_kernel", {"DOT16": True}),
]


# Driver processes, each compiling its share of the configurations (the sweep itself runs in each). Why two: a
# compile is single-threaded, and two use both cores of the 2-core CI machine (~2 min of wall time instead of ~4).
SHARDS = 2
# Every configuration instead of one per class (see the module docstring).
COMPILE_ALL = os.environ.get("SGLANG_EXT_TEST_COMPILE_ALL") == "1"


def _run_driver(tmp_path) -> dict:
    """The merged report of SHARDS driver processes run side by side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONDONTWRITEBYTECODE="1", TORCHDYNAMO_DISABLE="1")
    procs = []
    for shard in range(SHARDS):
        out = tmp_path / f"compiled{shard}.json"
        log = open(tmp_path / f"driver{shard}.log", "w")
        procs.append((out, log, subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(out), str(shard), str(SHARDS)], cwd=ROOT,
            env={**env, "TRITON_CACHE_DIR": str(tmp_path / f"triton_cache{shard}")}, stdout=log,
            stderr=subprocess.STDOUT, text=True)))
    merged = {"configs": [], "launchers": {}, "classes": {}, "reached": set(), "errors": [], "compile_seconds": 0.0}
    for out, log, proc in procs:
        try:
            proc.wait(timeout=1200)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = open(log.name).read()
        assert proc.returncode == 0 and out.exists(), f"driver failed ({log.name}):\n{text[-6000:]}"
        with open(out) as f:
            report = json.load(f)
        merged["configs"] += report["configs"]
        for launcher, keys in report["launchers"].items():
            merged["launchers"].setdefault(launcher, set()).update(keys)
        merged["classes"].update(report["classes"])
        merged["reached"] |= set(report["reached"])
        merged["errors"] += report["errors"]
        merged["compile_seconds"] += report["compile_seconds"]
        merged.update(triton=report["triton"], jit_functions=report["jit_functions"])
    return merged


def _device_questions() -> set:
    """(module, function) of every device-kind question in the shipped kernel modules' source."""
    import ast

    found = set()
    for name in _shipped_module_names():
        with open(_module_file(name)) as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                asks = (isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu")) or (
                    isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type"
                    and any(isinstance(c, ast.Constant) and c.value in ("cuda", "cpu") for c in node.comparators))
                if asks:
                    found.add((name, fn.name))
    return found


def test_device_questions_are_answered():
    """The sweep's meta tensors get an H200's answer wherever a launcher asks what device it is on."""
    found = _device_questions()
    assert found <= set(DEVICE_QUESTIONS), f"unanswered device questions (add to DEVICE_QUESTIONS): " \
                                           f"{sorted(found - set(DEVICE_QUESTIONS))}"
    assert set(DEVICE_QUESTIONS) <= found, f"stale DEVICE_QUESTIONS entries: {sorted(set(DEVICE_QUESTIONS) - found)}"


def test_every_shipped_kernel_compiles_for_sm90a(tmp_path):
    t0 = time.time()
    report = _run_driver(tmp_path)
    errors = report["errors"]
    assert not errors, f"{len(errors)} launches failed (triton {report['triton']}):\n" + "\n\n".join(
        f"[{e['launcher']}] {e['case']}\n{e['error']}" for e in errors[:5])
    configs = report["configs"]
    assert configs, "nothing compiled"
    compiled = {c["key"] for c in configs}
    assert len(compiled) == len(configs), "a configuration compiled in two shards"
    for c in configs:
        assert c["cubin_bytes"] > 0, f"{c['kernel']} {c['constexprs']}: empty cubin"
        assert c["target"] == "sm_90a", f"{c['kernel']} {c['constexprs']}: PTX .target {c['target']}, not sm_90a"
        if not c["launcher"].startswith(INTERPRETER_FORMS):
            for flag in INTERPRETER_ONLY_FLAGS:
                assert not c["constexprs"].get(flag), (
                    f"{c['kernel']} ({c['launcher']}): compiled in an interpreter-only form ({flag})")
    compiled_classes = {report["classes"][k] for k in compiled}
    for launcher, keys in report["launchers"].items():
        assert keys, f"launcher {launcher} reached no kernel"
        missing = {k for k in keys - compiled if report["classes"][k] not in compiled_classes}
        assert not missing, f"launcher {launcher}: {len(missing)} configurations of a class compiled nowhere"
    if COMPILE_ALL:
        assert set(report["classes"]) == compiled, "SGLANG_EXT_TEST_COMPILE_ALL: a configuration was not compiled"
    # every @triton.jit function of the shipped modules, compiled at least once
    shipped, reached = set(report["jit_functions"]), report["reached"]
    assert shipped, "no @triton.jit function found in the shipped modules"
    missing = sorted(shipped - reached)
    assert not missing, f"shipped @triton.jit functions never compiled: {missing}"
    for c in configs:  # the Hopper instructions the configuration asks for are in its PTX
        if c["constexprs"].get("USE_PDL"):
            assert "griddepcontrol" in c["ptx_has"], f"{c['kernel']} {c['constexprs']}: USE_PDL, no griddepcontrol"
        if any(t.startswith("desc<") for t in c["signature"]):
            assert "cp.async.bulk.tensor" in c["ptx_has"], f"{c['kernel']} {c['constexprs']}: descriptors, no TMA"
    assert any("wgmma.mma_async" in c["ptx_has"] for c in configs if c["kernel"] == "_fp8_gemm_tma_kernel")
    for kernel, want in GPU_REGIMES:
        assert any(c["kernel"] == kernel and all({**c["constexprs"], **c["options"]}.get(k) == v
                                                  for k, v in want.items()) for c in configs), (
            f"no compiled {kernel} with {want}: did a launcher take its CPU / interpreter branch?")
    kernels = {c["kernel"] for c in configs}
    served = {c["key"] for c in configs if not c["launcher"].startswith(ALTERNATIVES)}
    print(f"triton {report['triton']}: {len(kernels)} kernels in {len(configs)} of {len(report['classes'])} "
          f"configurations, {len(compiled_classes)} classes ({len(served)} from the served sweep), {len(reached & shipped)} of {len(shipped)} shipped @triton.jit functions, "
          f"sm_90a; {report['compile_seconds']:.0f} s compiling, {time.time() - t0:.0f} s wall")


# ------------------------------------------------------------------------------------------------------------
# The driver (the subprocesses): python tests/kernels/test_compile_sm90.py OUT.json SHARD SHARDS
# ------------------------------------------------------------------------------------------------------------

HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, TOP_K, LIMIT = 2880, 64, 64, 8, 4, 7.0
EXPERTS = {"gpt-oss-20b": 32, "gpt-oss-120b": 128}
VOCAB = 201088
# (model, TP size, EP size): the layouts served (20b on one H200 or two; 120b on 1..8, EP shards too)
LAYOUTS = [("gpt-oss-20b", 1, 1), ("gpt-oss-20b", 2, 1), ("gpt-oss-20b", 4, 4), ("gpt-oss-120b", 1, 1),
           ("gpt-oss-120b", 2, 1), ("gpt-oss-120b", 4, 1), ("gpt-oss-120b", 8, 1), ("gpt-oss-120b", 8, 8)]
DECODE_BATCHES = range(1, 257)
PREFILL_TOKENS = (257, 384, 512, 513, 1000, 1024, 1025, 2048, 4096, 8192)
MAX_CONTEXTS = (4096, 8192, 32768, 131072)  # req_to_token's width: the server's context length
WINDOW_LEFT = 127  # gpt-oss's sliding layers (128 keys inclusive)
PROBE = dict(taps=3, heads=8, head_dim=64, labels=10, windows=(2048, None))


class _Sweep:
    """The compile-only hooks and what they record: configurations compiled, per launcher the configurations
    it reached, the @triton.jit functions code-generated into a compiled kernel, and failures."""

    def __init__(self, shard: int, shards: int):
        import zlib

        from triton.compiler import code_generator
        from triton.runtime import jit as tjit

        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from compile_only import install_compile_only_h200, pretend_torch_has_h200

        self.configs: dict = {}  # key -> record, compiled here
        self.failed: dict = {}  # key -> error text
        self.launchers: dict = {}  # launcher -> keys it reached (compiled here or by another shard)
        self.classes: dict = {}  # key -> its class, for every configuration the sweep reached
        self.selected: set = set()  # keys to compile (in some shard): each class's first, each GPU regime's first
        self._selected_classes: set = set()
        self._regimes_met: set = set()
        self.reached: set = set()  # "module.function" of every @triton.jit function in a kernel compiled here
        self.errors: list = []
        self.compile_seconds = 0.0
        self.launcher = None
        self._records: dict = {}  # (fn, constexprs, options, types) -> (key, record)
        self._specs: dict = {}  # fn -> its parameters
        self._record = None
        self._calls: set = set()

        pretend_torch_has_h200()
        install_compile_only_h200(self._compiled)
        compile_run = tjit.JITFunction.run
        sweep = self

        def run(fn, *args, grid, warmup, **kwargs):
            key, record = sweep._config(fn, args, kwargs)
            sweep.launchers[sweep.launcher].add(key)
            if key in sweep.failed:
                raise RuntimeError(sweep.failed[key])
            if not sweep._select(key, record) or key in sweep.configs or zlib.crc32(key.encode()) % shards != shard:
                return None  # a compiled class, compiled already, or another shard's
            sweep._record, sweep._calls = record, set()
            record["launcher"] = sweep.launcher
            t0 = time.time()
            try:
                return compile_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            except Exception as e:  # noqa: BLE001  (recorded: the test fails with it)
                sweep.failed[key] = (f"{record['kernel']} {record['constexprs']} {record['options']}: "
                                     f"{type(e).__name__}: {str(e)[-3000:]}")
                raise RuntimeError(sweep.failed[key]) from e
            finally:
                record["seconds"] = round(time.time() - t0, 2)
                sweep.compile_seconds += record["seconds"]
                if key not in sweep.configs and key not in sweep.failed:
                    sweep.failed[key] = f"{record['kernel']}: the launch compiled nothing"
                print(f"{record['seconds']:6.2f} s  {record['kernel']} {record['constexprs']} {record['options']}",
                      flush=True)

        tjit.JITFunction.run = run
        call_jit = code_generator.CodeGenerator.call_JitFunction

        def call_jit_function(generator, fn, *args, **kwargs):
            # every @triton.jit function code-generated into the kernel being compiled (constexpr-dead calls
            # are never visited, so this is what the kernel really contains)
            sweep._calls.add(_qualified(fn))
            return call_jit(generator, fn, *args, **kwargs)

        code_generator.CodeGenerator.call_JitFunction = call_jit_function

    def _select(self, key: str, record: dict) -> bool:
        """Whether the configuration is compiled (by some shard): every one under COMPILE_ALL, else the first of its
        class and the first matching each GPU_REGIMES entry. Every shard runs the same sweep, so every shard
        makes the same choices."""
        if key in self.selected:
            return True
        if key in self.classes:
            return False
        cls = self.classes[key] = json.dumps([record["module"], record["kernel"], record["signature"], record["options"],
                                              {k: v for k, v in record["constexprs"].items()
                                               if not isinstance(v, (int, float)) or isinstance(v, bool)}],
                                             sort_keys=True)
        regimes = {i for i, (kernel, want) in enumerate(GPU_REGIMES) if kernel == record["kernel"] and all(
            {**record["constexprs"], **record["options"]}.get(k) == v for k, v in want.items())}
        if COMPILE_ALL or cls not in self._selected_classes or regimes - self._regimes_met:
            self.selected.add(key)
            self._selected_classes.add(cls)
            self._regimes_met |= regimes
            return True
        return False

    def _config(self, fn, args, kwargs):
        """(key, record) of a launch: the kernel, its constexprs, the launch options and the argument types
        (dtype of each tensor, descriptor dtype and block shape); not the values of plain integers or pointers.
        Called for every launch of the sweep (~10^5), so without inspect's binding."""
        import inspect

        import torch
        from triton.tools.tensor_descriptor import TensorDescriptor

        spec = self._specs.get(fn)
        if spec is None:
            defaults = {p.name: p._param.default for p in fn.params if p._param.default is not inspect.Parameter.empty}
            spec = self._specs[fn] = ([(p.name, p.is_constexpr) for p in fn.params], set(fn.arg_names), defaults)
        params, names, defaults = spec
        values = dict(defaults)
        values.update(zip(fn.arg_names, args))
        constexprs, types, options = [], [], []
        for k, v in kwargs.items():
            if k in names:
                values[k] = v
            else:
                options.append((k, _plain(v)))
        for name, is_constexpr in params:
            v = values[name]
            if is_constexpr:
                constexprs.append((name, _plain(v)))
            elif isinstance(v, torch.Tensor):
                types.append(str(v.dtype)[6:])
            elif isinstance(v, TensorDescriptor):
                types.append(f"desc<{str(v.base.dtype)[6:]}{list(v.block_shape)}>")
            else:
                types.append(type(v).__name__)
        fast = (fn, tuple(constexprs), tuple(sorted(options)), tuple(types))
        found = self._records.get(fast)
        if found is None:
            record = {"kernel": fn.fn.__name__, "module": fn.fn.__module__, "constexprs": dict(constexprs),
                      "options": dict(sorted(options)), "signature": types}
            record["key"] = json.dumps([record["module"], record["kernel"], record["constexprs"], record["options"],
                                        types], sort_keys=True)
            found = self._records[fast] = (record["key"], record)
        return found

    def _compiled(self, fn, kernel, kwargs):
        import re

        record = self._record
        ptx = kernel.asm["ptx"]
        target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
        record.update(cubin_bytes=len(kernel.asm["cubin"]), target=target.group(1) if target else None,
                      ptx_has=[marker for marker in PTX_MARKERS if marker in ptx])
        self.configs[record["key"]] = record
        self.reached |= self._calls | {_qualified(fn)}

    def launch(self, launcher: str, case: str, call, *args, **kwargs):
        """call(*args, **kwargs) as `launcher`; a failure is recorded (with the case) and the sweep goes on."""
        self.launcher = launcher
        self.launchers.setdefault(launcher, set())
        try:
            return call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            import traceback

            text = str(e)
            if not any(x["error"] == text for x in self.errors):  # one line per distinct failure
                self.errors.append({"launcher": launcher, "case": case, "error": text[-3000:],
                                    "where": traceback.format_exc()[-2000:]})
            return None


def _qualified(fn) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__name__}"


def _plain(v):
    v = getattr(v, "value", v)  # tl.constexpr
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)


def _fake_h200_device_answers():
    """The launchers' questions about a device, for meta tensors answered as for cuda:0 on an H200 (PDL, TMA
    and the SM count; torch's own answers are pretend_torch_has_h200's). Every module binding of these
    functions is replaced (some modules import them by name)."""
    import importlib

    import torch

    cuda0 = torch.device("cuda", 0)
    targets = [key for key, how in DEVICE_QUESTIONS.items() if how == "answered for cuda:0"]
    modules = {m: importlib.import_module(f"sglang_ext.kernels.{m}") for m in _shipped_module_names()}
    for mod_name, fn_name in targets:
        original = getattr(modules[mod_name], fn_name)

        def as_cuda(*args, _original=original, **kwargs):
            swap = lambda v: cuda0 if isinstance(v, torch.device) and v.type == "meta" else v  # noqa: E731
            return _original(*map(swap, args), **{k: swap(v) for k, v in kwargs.items()})

        for mod in modules.values():
            for attr, value in list(vars(mod).items()):
                if value is original:
                    setattr(mod, attr, as_cuda)


def _shipped_module_names() -> list:
    """Every module under kernels/, named below sglang_ext.kernels: a module file as NAME, a package (a folder with
    an __init__.py, e.g. kernels/sink_attention/) as NAME (its __init__) and NAME.SUB for each of its modules."""
    top = os.path.join(ROOT, "kernels")
    names = []
    for folder, subfolders, files in os.walk(top):
        subfolders[:] = [d for d in subfolders if os.path.exists(os.path.join(folder, d, "__init__.py"))]
        package = os.path.relpath(folder, top).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                name = ("" if package == "." else package) if f == "__init__.py" else (
                    f[:-3] if package == "." else f"{package}.{f[:-3]}")
                if name:
                    names.append(name)
    return sorted(names)


def _module_file(name: str) -> str:
    """The source file of a `_shipped_module_names` entry."""
    path = os.path.join(ROOT, "kernels", *name.split("."))
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def _jit_functions() -> list:
    import importlib

    from triton.runtime.jit import JITFunction

    out = []
    for m in _shipped_module_names():
        mod = importlib.import_module(f"sglang_ext.kernels.{m}")
        out += [_qualified(v) for v in vars(mod).values()
                if isinstance(v, JITFunction) and v.fn.__module__ == mod.__name__]
    return sorted(out)


def _meta(*shape, dtype=None):
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


def _fp8_weight(*shape):
    """e4m3 [..., N, K] and its block-128 fp32 scales [..., cdiv(N, 128), cdiv(K, 128)]."""
    import torch

    lead, (n, k) = shape[:-2], shape[-2:]
    return (_meta(*shape, dtype=torch.float8_e4m3fn),
            _meta(*lead, -(-n // 128), -(-k // 128), dtype=torch.float32))


def _layout_shapes():
    """Distinct (attention, MoE) shard shapes over every rank of LAYOUTS, from the model's own sharding rules
    (sglang_ext.layers.parallel): attention (q heads, kv heads, q rows, kv rows incl. front padding, bias on o,
    kv padding); MoE (router experts, local experts, expert offset, local intermediate, b2 here)."""
    from sglang_ext.layers.parallel import (BlockShard, ParallelLayout, attention_head_shard, moe_shard)

    attention, moe = {}, {}
    for model, tp, ep in LAYOUTS:
        for rank in range(tp):
            layout = ParallelLayout(tp_size=tp, tp_rank=rank, ep_size=ep)
            heads = [attention_head_shard(Q_HEADS, KV_HEADS, tp, r) for r in range(tp)]
            q = BlockShard.of(Q_HEADS * HEAD_DIM, [h.q_rows(HEAD_DIM) for h in heads], rank)
            kv = BlockShard.of(KV_HEADS * HEAD_DIM, [h.kv_rows(HEAD_DIM) for h in heads], rank)
            h = heads[rank]
            # the padding and the expert offset move pointers only: one rank stands for the others
            attention.setdefault((h.q_hi - h.q_lo, h.kv_hi - h.kv_lo, q.local_len, kv.local_len, tp == 1),
                                 kv.pad_front)
            shard = moe_shard(EXPERTS[model], HIDDEN, layout, fp8=True)  # intermediate 2880, as hidden
            moe.setdefault((EXPERTS[model], shard.expert_hi - shard.expert_lo, shard.inter_hi - shard.inter_lo,
                            tp == 1), shard.expert_lo)
    return ([(*shape, pad) for shape, pad in sorted(attention.items())],
            [(e, local, offset, inter, single) for (e, local, inter, single), offset in sorted(moe.items())])


def _drive(out_path: str, shard: int, shards: int) -> None:
    import torch
    import triton

    os.environ.pop("TRITON_INTERPRET", None)
    sweep = _Sweep(shard, shards)
    _fake_h200_device_answers()
    from sglang_ext.kernels import (fp8_gemm, moe, pdl, probe_attention, probe_step, probe_tail, residual_norm,
                                    rope_kv, sink_attention)

    t_start = time.time()
    attention_shapes, moe_shapes = _layout_shapes()
    tokens_all = list(DECODE_BATCHES) + list(PREFILL_TOKENS)
    fp32, i32, i64, fp8 = torch.float32, torch.int32, torch.int64, torch.float8_e4m3fn
    cdiv = triton.cdiv

    def quant_of(t, c):
        """x's e4m3 codes and MN-major scales, as the residual norm's quantize leaves them"""
        return _meta(t, c, dtype=fp8), _meta(cdiv(c, 128), t, dtype=fp32).t()

    for pdl_on in (True, False):  # PDL on (default) / off (GPUs before sm90); it applies to <= 16 rows only
        pdl.set_pdl(None if pdl_on else False)
        tokens = tokens_all if pdl_on else list(range(1, pdl.PDL_MAX_ROWS + 1))
        tag = "" if pdl_on else " (PDL off)"

        # -- norms: the input norm (quantising for the qkv GEMM, the probe's taps), post-attention, final
        w_norm = _meta(HIDDEN)
        features = _meta(max(tokens), HIDDEN * PROBE["taps"])
        for t in tokens:
            h = _meta(t, HIDDEN)
            for delta in (None, h):
                for quantize in (True, False):
                    for tap in (None, (features, HIDDEN, 1e-5)):
                        sweep.launch("residual_rms_norm" + tag, f"T={t} delta={delta is not None} "
                                     f"quantize={quantize} tap={tap is not None}",
                                     residual_norm.residual_rms_norm, h, delta, w_norm, 1e-5, tap, quantize)

        # -- dense FP8 layers: qkv (x quantised by the norm), o (bf16 x; no bias on a TP rank), the FP8 LM head
        for hq, hkv, q_rows, kv_rows, single, kv_pad in attention_shapes:
            n_qkv = q_rows + 2 * kv_rows
            w_qkv, b_qkv = _fp8_weight(n_qkv, HIDDEN), _meta(n_qkv)
            w_o, b_o = _fp8_weight(HIDDEN, q_rows), (_meta(HIDDEN) if single else None)
            for t in tokens:
                x = _meta(t, HIDDEN)
                case = f"T={t} qkv N={n_qkv}"
                sweep.launch("fp8_linear qkv" + tag, case, fp8_gemm.fp8_linear, x, *w_qkv, b_qkv,
                             x_quant=quant_of(t, HIDDEN))
                sweep.launch("fp8_gemm qkv" + tag, case, fp8_gemm.fp8_gemm, *quant_of(t, HIDDEN), *w_qkv, b_qkv)
                sweep.launch("fp8_linear o" + tag, f"T={t} o K={q_rows}", fp8_gemm.fp8_linear, _meta(t, q_rows),
                             *w_o, b_o)
        for tp in (1, 8):  # SGLANG_EXT_FP8_LM_HEAD=1: the vocab-parallel head, logits for the sampling rows
            w_head = _fp8_weight(-(-VOCAB // (64 * tp)) * 64, HIDDEN)
            for t in tokens:
                sweep.launch("fp8_linear lm_head" + tag, f"T={t} TP{tp}", fp8_gemm.fp8_linear, _meta(t, HIDDEN),
                             *w_head)
        sweep.launch("quantize_activation_group128" + tag, "T=1000", fp8_gemm.quantize_activation_group128,
                     _meta(1000, HIDDEN))

        # -- MoE: the table's rows over every token count, each shard shape
        for num_experts, num_local, offset, inter, single in moe_shapes:
            router = (_meta(num_experts, HIDDEN), _meta(num_experts))
            w1, b1 = _fp8_weight(num_local, 2 * inter, HIDDEN), _meta(num_local, 2 * inter)
            w2, b2 = _fp8_weight(num_local, HIDDEN, inter), (_meta(num_local, HIDDEN) if single else None)
            for t in tokens:
                sweep.launch("fused_moe_fp8" + tag, f"T={t} E={num_experts} local={num_local} I={inter}",
                             moe.fused_moe_fp8, _meta(t, HIDDEN), *router, *w1, b1, *w2, b2, top_k=TOP_K,
                             limit=LIMIT, expert_offset=offset, return_routing=True)

        # -- attention: decode (split loop / one-shot, RoPE + KV write fused or rope_store_kv first), extend over a
        # cached prefix, prefill without one (keys from the forward's rows, by TMA)
        for hq, hkv, q_rows, kv_rows, _, kv_pad in attention_shapes:
            slots = 1 << 16
            k_cache, v_cache, sinks = _meta(slots, hkv, HEAD_DIM), _meta(slots, hkv, HEAD_DIM), _meta(hq, dtype=fp32)
            slot_map = _meta(slots, dtype=i64)
            n_qkv = q_rows + 2 * kv_rows

            def qkv_views(t):
                """q, k, v as the attention layer hands them over: column views of the qkv GEMM's output"""
                qkv = _meta(t, n_qkv)
                k0, v0 = q_rows + kv_pad, q_rows + kv_rows + kv_pad
                return (qkv[:, :q_rows].view(t, hq, HEAD_DIM), qkv[:, k0:k0 + hkv * HEAD_DIM].view(t, hkv, HEAD_DIM),
                        qkv[:, v0:v0 + hkv * HEAD_DIM].view(t, hkv, HEAD_DIM))

            for max_context in MAX_CONTEXTS:
                req_to_token = _meta(257, max_context, dtype=i32)
                for b in tokens:
                    if b > 256:
                        continue
                    q, k, v = qkv_views(b)
                    cos_sin, loc = _meta(b, HEAD_DIM, dtype=fp32), _meta(b, dtype=i64)
                    rpi, seq_lens = _meta(b, dtype=i64), _meta(b, dtype=i64)
                    # a sliding layer reads its last 128 keys whatever the context: one context is enough
                    sliding = [(WINDOW_LEFT, None), (WINDOW_LEFT, slot_map)] if max_context == MAX_CONTEXTS[0] else []
                    for window, smap in [(-1, None)] + sliding:
                        case = f"B={b} heads {hq}/{hkv} ctx={max_context} window={window} swa={smap is not None}"
                        for fused in (True, False):  # RoPE fused into the decode (default) / set_rope_fusion(False)
                            sink_attention.set_rope_fusion(fused)
                            sweep.launch("sink_attention_decode" + tag, case + f" rope_fusion={fused}",
                                         sink_attention.sink_attention_decode, q, k_cache, v_cache,
                                         req_to_token, rpi, seq_lens, sinks, window, 0.125, slot_map=smap,
                                         out=_meta(b, hq, HEAD_DIM),
                                         rope=sink_attention.RopeKV(k, v, cos_sin, loc))
                        sink_attention.set_rope_fusion(None)
            for t in tokens:
                if t < 257 and t not in (1, 16, 100, 256):
                    continue  # extend / prefill configurations do not depend on the row count
                q, k, v = qkv_views(t)
                cos_sin, loc = _meta(t, HEAD_DIM, dtype=fp32), _meta(t, dtype=i64)
                reqs = 2 if t > 1 else 1
                q_len, q_start = _meta(reqs, dtype=i32), _meta(reqs, dtype=i32)
                rpi, seq_lens = _meta(reqs, dtype=i64), _meta(reqs, dtype=i64)
                req_to_token = _meta(257, 131072, dtype=i32)
                for window, smap in ((-1, None), (WINDOW_LEFT, None), (WINDOW_LEFT, slot_map)):
                    case = f"T={t} heads {hq}/{hkv} window={window} swa={smap is not None}"
                    q_roped = sweep.launch("rope_store_kv" + tag, case, rope_kv.rope_store_kv, q, k, v, cos_sin,
                                           k_cache, v_cache, loc)
                    sweep.launch("sink_attention_extend" + tag, case, sink_attention.sink_attention_extend,
                                 q_roped if q_roped is not None else q.contiguous(), k_cache, v_cache, req_to_token,
                                 rpi, seq_lens, q_start, q_len, sinks, window, 0.125, slot_map=smap,
                                 out=_meta(t, hq, HEAD_DIM))
                    if smap is None:  # no cached prefix: rows, not slots
                        k_roped = _meta(t, hkv, HEAD_DIM)
                        q_roped = sweep.launch("rope_store_kv" + tag, case + " k_out", rope_kv.rope_store_kv, q, k,
                                               v, cos_sin, k_cache, v_cache, loc, k_out=k_roped)
                        sweep.launch("sink_attention_prefill" + tag, case, sink_attention.sink_attention_prefill,
                                     q_roped if q_roped is not None else q.contiguous(), k_roped, v, q_start, q_len,
                                     sinks, 0.125, window_left=window, out=_meta(t, hq, HEAD_DIM))
                    sweep.launch("paged_attention" + tag, case, sink_attention.paged_attention, q,
                                 k_cache, v_cache, req_to_token, rpi, seq_lens, q_start, q_len, sinks, window, 0.125,
                                 slot_map=smap, rope=sink_attention.RopeKV(k, v, cos_sin, loc),
                                 no_prefix=smap is None)

        # -- the SingProbe: tap normalisation, the decode step (three launches), the prefill's attention + tail
        width, heads, hd, labels = HIDDEN * PROBE["taps"], PROBE["heads"], PROBE["head_dim"], PROBE["labels"]
        hq_p = heads * hd
        w_qkv_p, kv_pool = _meta(hq_p + 2 * hd, width), _meta(1 << 16, 2 * hd)
        wo, norm_w, wc, bc = _meta(hq_p, hq_p), _meta(hq_p), _meta(labels, hq_p), _meta(labels)
        workspace = probe_step.ProbeStepWorkspace(torch.device("meta"))
        req_to_token = _meta(257, 131072, dtype=i32)
        for t in tokens:
            for window in PROBE["windows"]:
                case = f"T={t} window={window}"
                if t <= 256:
                    sweep.launch("probe_decode_step" + tag, case, probe_step.probe_decode_step, _meta(t, width),
                                 w_qkv_p, kv_pool, _meta(t, dtype=i64), req_to_token, _meta(t, dtype=i64), None,
                                 window, hd ** -0.5, wo, norm_w, wc, bc, _meta(t, labels, dtype=fp32), heads,
                                 workspace=workspace, seq_lens=_meta(t, dtype=i64))
                # a prefill: one sampling row per request (the splits depend on how many)
                q_rows = _meta(t, heads, hd)
                ctx = sweep.launch("probe_attention" + tag, case, probe_attention.probe_attention, q_rows, kv_pool,
                                   req_to_token, _meta(t, dtype=i64), _meta(t, dtype=i64), window, hd ** -0.5)
                sweep.launch("probe_tail" + tag, case, probe_tail.probe_tail, q_rows,
                             ctx if ctx is not None else _meta(t, heads, hd, dtype=fp32), wo, norm_w, wc, bc)
            sweep.launch("probe_tap_normalize" + tag, f"T={t}", probe_step.probe_tap_normalize, _meta(t, HIDDEN),
                         _meta(t, width), HIDDEN, 1e-5)
    pdl.set_pdl(None)

    served_seconds = time.time() - t_start
    _drive_alternatives(sweep)

    result = {
        "triton": triton.__version__,
        "configs": list(sweep.configs.values()),
        "launchers": {k: sorted(v) for k, v in sweep.launchers.items()},
        "classes": sweep.classes,
        "reached": sorted(sweep.reached),
        "jit_functions": _jit_functions(),
        "errors": sweep.errors,
        "compile_seconds": sweep.compile_seconds,
        "served_seconds": served_seconds,
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    kernels = {c["kernel"] for c in sweep.configs.values()}
    slowest = sorted(sweep.configs.values(), key=lambda c: -c.get("seconds", 0))[:8]
    print(f"triton {triton.__version__}: {len(kernels)} kernels, {len(sweep.configs)} configurations, "
          f"{len(sweep.errors)} failures; {sweep.compile_seconds:.0f} s compiling; slowest: "
          + ", ".join(f"{c['kernel']} {c.get('seconds')}s" for c in slowest))


def _drive_alternatives(sweep: _Sweep) -> None:
    """The shipped kernels and helpers that no served row compiles, once each at gpt-oss-120b's TP1 shapes: the
    split-K sums as their own launch (the fallback where the arrival counters cannot be made), the benchmarks'
    row that alone calls `_mlp2_combine_oneshot_kernel` / `_mlp2_h_side`, and the interpreter's form that alone
    calls `_round_to_bf16_grid`. (Not every benchmark row: those are options, not what the server runs.)"""
    from dataclasses import replace

    from sglang_ext.kernels import fp8_gemm
    from sglang_ext.kernels.moe import oneshot

    alt = "alternative: "
    w_qkv, b_qkv = _fp8_weight(5120, HIDDEN), _meta(5120)
    w_o, b_o = _fp8_weight(HIDDEN, 4096), _meta(HIDDEN)
    x1, x8 = _meta(1, HIDDEN), _meta(8, HIDDEN)

    # the split-K sums as a second launch (inline_reduce off): the decode GEMV's and the GEMM's; what a CUDA-graph
    # capture runs where arrival_counters cannot make the counters (it returns None)
    sweep.launch(alt + "fp8 GEMV, split-K sum launch", "T=8 qkv", fp8_gemm.fp8_linear, x8, *w_qkv, b_qkv,
                 config=replace(fp8_gemm.split_k_gemv_config(8, 5120, HIDDEN), inline_reduce=False))
    sweep.launch(alt + "fp8 GEMM, split-K sum launch", "T=32 o", fp8_gemm.fp8_linear, _meta(32, 4096), *w_o, b_o,
                 config=replace(fp8_gemm.gemm_config(32, HIDDEN, 4096), inline_reduce=False))

    router = (_meta(128, HIDDEN), _meta(128))
    experts = (*_fp8_weight(128, 2 * HIDDEN, HIDDEN), _meta(128, 2 * HIDDEN),
               *_fp8_weight(128, HIDDEN, HIDDEN), _meta(128, HIDDEN))
    # the one-shot MoE decode with mlp2 per token (bench_moe_decode.py's; the table's one-shot row runs it per pair)
    sweep.launch(alt + "one-shot MoE, per-token mlp2", "T=1", oneshot.fused_moe_fp8_oneshot, x1, *router,
                 *experts, top_k=TOP_K, limit=LIMIT, config=oneshot.DEFAULT_ONESHOT)

    # the interpreter's form of the FP8 GEMV (bf16 rounding emulated, e4m3 grid rounding), compiled for sm_90a
    # (`interpreted` patched where the GEMV's launchers look it up)
    interpreted = fp8_gemm.gemv.interpreted
    fp8_gemm.gemv.interpreted = lambda: True
    try:
        sweep.launch(INTERPRETER_FORMS + ": fp8 GEMV", "T=1 qkv", fp8_gemm.fp8_linear, x1, *w_qkv, b_qkv)
    finally:
        fp8_gemm.gemv.interpreted = interpreted


if __name__ == "__main__":
    _drive(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
