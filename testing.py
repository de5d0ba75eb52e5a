"""What the test files share: tiny models, closeness, gloo ranks on the CPU, run.py in a subprocess,
the GPU tests' models and captured calls. Imported after conftest.py has set the environment
(TRITON_INTERPRET=1 on a machine without CUDA, one thread a process)."""
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import checkpoint
import kernels
import tp
from checkpoint import init_random, init_random_draft, save_target
from draft import Eagle3Draft, Tree, draft_preset
from graphs import GraphKey
from model import Transformer

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_PY = os.path.join(HERE, "run.py")
CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # run.py as a user runs it on the CPU (no GPU)
ONE_THREAD = dict(CPU_ENV, OMP_NUM_THREADS="1")       # and on one thread, whatever the caller's
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------
# run.py in a subprocess, as a user runs it

def run_py(*args, ranks=1, env=CPU_ENV, **kw):
    """run.py with `args` in a subprocess, as a user runs it (the GPU hidden by default), or under
    torchrun with `ranks` gloo ranks; its CompletedProcess, output captured as text. kw go to
    subprocess.run (check, timeout)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return subprocess.run([sys.executable, *(launcher if ranks > 1 else []), RUN_PY, *args],
                          capture_output=True, text=True, cwd=HERE, env=env, **kw)


def run_py_at_once(*arg_lists, **kw):
    """run.py once for each argument list, two processes at a time on one thread each (CI's two
    cores), as run_py runs it (kw: check, timeout); their CompletedProcesses in order."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: run_py(*args, env=ONE_THREAD, **kw), arg_lists))


def ranks_stderr(out, chars=2000):
    """The end of a torchrun run's stderr before torchrun's own report of a failed rank (its
    traceback and summary would push the ranks' messages out of a failed assertion's text)."""
    lines = out.stderr.splitlines()
    cut = next((i for i, line in enumerate(lines)
                if "distributed/elastic" in line or "distributed.elastic" in line), len(lines))
    return "\n".join(lines[:cut])[-chars:]


# ---------------------------------------------------------------------------------------------
# Tiny models and their steps, closeness, gloo ranks on the CPU

def tiny(**kw):
    return checkpoint.preset("tiny", **kw)


def assert_close(a, b, atol, what):
    diff = (a.double() - b.double()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3e} > {atol:.1e}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    tp.init_distributed("cpu")
    orderly = False
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
        orderly = True
    finally:
        tp.leave_group(orderly)


def run_ranks(world, fn, *args):
    """Run fn(*args) on `world` gloo ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        mp.spawn(_rank_main, args=(world, _free_port(), fn, args, out), nprocs=world, join=True)
        return torch.load(out)


def step_inputs(vocab, seed=0):
    """A 12-token prefill for 3 rows, then a 3-token step with every row at its own position
    (rows 1 and 2 go back and overwrite slots, as a rejected draft would)."""
    g = torch.Generator().manual_seed(seed)
    prefill = torch.randint(0, vocab, (3, 12), generator=g)
    step = torch.randint(0, vocab, (3, 3), generator=g)
    step_pos = torch.tensor([[12, 13, 14], [10, 11, 12], [7, 8, 9]])
    return prefill, torch.arange(12).expand(3, 12), step, step_pos


def run_steps(m):
    """Logits of the prefill and of the step in both attention modes, concatenated along T; the
    inputs (step_inputs') on the model's device."""
    prefill, prefill_pos, step, step_pos = (t.to(m.device) for t in step_inputs(m.args.vocab_size))
    outs = [m(prefill, prefill_pos, "extend").logits]
    for mode in ("extend", "decode"):
        outs.append(m(step, step_pos, mode).logits)
    return torch.cat(outs, 1)


# ---------------------------------------------------------------------------------------------
# Speculative decoding: prompts, a planted proposer, random trees

PROMPTS = {1: [[11, 12, 13, 14, 15, 16]],
           3: [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29],
               [31, 32, 33, 34, 35, 36, 37]]}


class PlantedProposer:
    """Stands in for an Eagle3Draft in verify.generate (its extend and chain; it keeps Python state,
    so it runs eager: generate without use_graphs, which would capture it once). Knows the
    target's greedy sequence `ref` [B, L] (by position) and errs where told: on its c-th chain,
    row b's first wrong draft is number wrong_at(c, b) (0-based; >= k: all right)."""

    def __init__(self, ref, vocab, wrong_at):
        self.ref, self.vocab, self.wrong_at, self.calls = ref, vocab, wrong_at, 0

    def extend(self, tokens, positions, hidden, last, kv_len=None):
        return None, None  # the planted drafts need only the position chain() is given

    def chain(self, first, g, last_pos, num_steps, kv_len=None):
        """last_pos [B]: the position of the last extend row; draft j (1-based) guesses position
        last_pos+1+j."""
        idx = (last_pos.unsqueeze(1) + 1
               + torch.arange(1, num_steps + 1)).clamp(max=self.ref.shape[1] - 1)
        drafts = self.ref.gather(1, idx)
        first_wrong = torch.tensor([self.wrong_at(self.calls, b) for b in range(len(drafts))])
        self.calls += 1
        wrong = torch.arange(num_steps) == first_wrong.unsqueeze(1)
        return torch.where(wrong, (drafts + 1) % self.vocab, drafts)


def reference_sequences(prompts, outputs, length):
    ref = torch.zeros(len(prompts), length, dtype=torch.int64)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        seq = torch.tensor(p + o)
        ref[b, :len(seq)] = seq
    return ref


def random_tree(B, N, V, g):
    """Parents drawn before their children; every token distinct (so siblings' are)."""
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                for i in range(1, N)])
                           for _ in range(B)])
    tokens = torch.stack([torch.randperm(V, generator=g)[:N] for _ in range(B)])
    depths = torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):
        depths[:, i] = depths.gather(1, parents[:, i:i + 1]).squeeze(1) + 1
    return Tree(tokens, parents, depths, torch.zeros(B, N))


# ---------------------------------------------------------------------------------------------
# The GPU tests' models and captured calls

def gpu_models(dtype=torch.bfloat16, B=3, seed=0, quant=None, moe_impl=None, kernels_on="none"):
    """The tiny target on the GPU (random weights, `seed`) with `kernels_on` swapped in
    (kernels.accelerate's names), and its random draft head. moe_impl: the routed experts' path
    (kernels.pick_moe); None: "gather" with kernels_on "none" (the plain model, no Triton launch),
    else "auto" (on CUDA with Triton: the fused MoE)."""
    target = init_random(Transformer(tiny(quantization_config=quant), max_batch_size=B,
                                     max_seq_len=64,
                                     device="cuda", dtype=dtype), seed)
    if moe_impl is None:
        moe_impl = "gather" if kernels_on == "none" else "auto"
    kernels.accelerate(target, kernels_on, moe=moe_impl)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    return target, head


def captured_calls(target, head, k=3, B=3, P=12, seed=0):
    """(key, fn, inputs) for every captured shape, on a cache prefilled with P random tokens a row
    (seed: their generator's)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (B, P), generator=g).cuda()
    _, aux = target(tokens, torch.arange(P, device="cuda").expand(B, P), "extend", capture_aux=True)
    pos = P + torch.arange(k + 1, device="cuda").expand(B, k + 1)
    vt = tokens[:, :k + 1]
    last = torch.tensor([k, 1, 0], device="cuda")[:B]
    first, gh = head.extend(vt, pos, aux[:, :k + 1], last)
    return [(GraphKey("decode_step", "decode", B, 1), partial(target, mode="decode"),
             (vt[:, :1], pos[:, :1])),
            (GraphKey("verify", "extend", B, k + 1),
             partial(target, mode="extend", capture_aux=True), (vt, pos)),
            (GraphKey("verify", "decode", B, k + 1),
             partial(target, mode="decode", capture_aux=True), (vt, pos)),
            (GraphKey("draft_extend", None, B, k + 1), head.extend,
             (vt, pos, aux[:, :k + 1], last)),
            (GraphKey("draft", None, B, k - 1), partial(head.chain, num_steps=k),
             (first, gh, pos[:, 0] + last))]


def flat(out):
    return torch.cat([t.double().flatten() for t in (out if isinstance(out, tuple) else (out,))
                      if t is not None])


def eager_without_pdl(fn, *inputs):
    """fn run eagerly with the kernels' launches not asking for programmatic dependent launch: a
    reference in which every kernel starts after the one before it has finished."""
    with kernels.common.pdl_off():
        return fn(*inputs)


# ---------------------------------------------------------------------------------------------
# Checkpoints: quantized ones with their dequantized twins, edited ones

def int4_checkpoint(d, **shape):
    """The tiny model (changed by `shape`) with INT4 experts in the Kimi-K2.5 layout (text_config,
    `language_model.` prefix, a vision tower to skip), sharded; and the same weights dequantized,
    saved plain."""
    args = tiny(**{"moe_intermediate_size": 64, **shape}, quantization_config="int4")
    m = init_random(Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32), 5)
    tensors = checkpoint.checkpoint_tensors(m, "language_model.")
    tensors.update({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3),
                    "mm_projector.proj.0.weight": torch.zeros(2)})
    quant, plain = os.path.join(d, "int4"), os.path.join(d, "plain")
    os.makedirs(quant)
    checkpoint.write_safetensors(tensors, quant, max_shard_bytes=300_000)
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump({"architectures": ["KimiK25ForConditionalGeneration"], "vision_config": {},
                   "text_config": checkpoint.target_config(args)}, f)
    ref = Transformer(tiny(**{"moe_intermediate_size": 64, **shape}), max_batch_size=3,
                      max_seq_len=32, dtype=torch.float32)
    for name, p in ref.named_parameters():
        p.copy_(int4_twin(tensors, name, args) if ".mlp.experts." in name
                else m.get_parameter(name))
    save_target(ref, plain)
    return quant, plain


def int4_twin(tensors, name, args):
    """Routed experts `name` (e.g. "layers.1.mlp.experts.gate_proj") [E, out, in], dequantized
    here from the saved words and scales, independently of model.py: element c of a row sits in
    word c // 8 at bits 4 * (c % 8)..+3, stored as q + 8; one scale per int4_group_size columns."""
    layer, proj = name.split(".mlp.experts.")
    shifts = torch.arange(0, 32, 4)
    experts = []
    for e in range(args.n_routed_experts):
        k = f"language_model.model.{layer}.mlp.experts.{e}.{proj}.weight_"
        q = ((tensors[k + "packed"].long().unsqueeze(-1) >> shifts) & 0xF).flatten(-2) - 8
        experts.append(q * tensors[k + "scale"].repeat_interleave(args.int4_group_size, -1))
    return torch.stack(experts)


def fp8_checkpoint(d, block=(32, 24), **shape):
    """The tiny model with every projection FP8 in 32 x 24 blocks (not square, so rows and columns
    cannot be mixed up; edges partial: kv_a_proj_with_mqa's 40 rows, 64 columns; TP 2 slices that
    start inside a block along rows, q_b_proj's at 48 and the experts' gate_proj and up_proj at
    16, and along columns, o_proj's at 32), and the same weights dequantized here, independently
    of the loader, saved plain. `shape` changes the tiny model."""
    m = init_random(Transformer(tiny(**shape), max_batch_size=3, max_seq_len=32,
                                dtype=torch.float32), 6)
    quant, plain = os.path.join(d, "fp8"), os.path.join(d, "plain")
    save_target(m, plain)
    tensors, deq = load_file(os.path.join(plain, "model.safetensors")), {}
    br, bc = block
    for k in [k for k in tensors if k.endswith(("_proj.weight", "_proj_with_mqa.weight"))]:
        w = tensors[k]
        rows, cols = -(-w.shape[0] // br), -(-w.shape[1] // bc)
        padded = torch.zeros(rows * br, cols * bc)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.unflatten(0, (rows, br)).unflatten(2, (cols, bc)).abs().amax((1, 3))
        scale = amax.clamp(min=1e-12) / 448
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:w.shape[0], :w.shape[1]]
        tensors[k] = (w / full).to(torch.float8_e4m3fn)
        tensors[k + "_scale_inv"] = scale
        deq[k] = tensors[k].float() * full
    os.makedirs(quant)
    checkpoint.write_safetensors(tensors, quant, max_shard_bytes=200_000)
    save_file({**load_file(os.path.join(plain, "model.safetensors")), **deq},
              os.path.join(plain, "model.safetensors"))
    cfg = dict(checkpoint.target_config(m.args),
               quantization_config={"quant_method": "fp8", "fmt": "e4m3",
               "activation_scheme": "dynamic", "weight_block_size": list(block)})
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(cfg, f)
    return quant, plain


def edit_checkpoint(src, dst, edit):
    os.makedirs(dst)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst,
                                                                        "config.json"), "w") as g:
        g.write(f.read())


# ---------------------------------------------------------------------------------------------
# The bytes a Triton launch reads, counted under the CPU interpreter

class Reads:
    """The loads that kernels issued inside one tensor: the byte offset of each mask-true element
    loaded, and its size. bytes: every load counted (an element loaded twice, twice); distinct:
    the bytes loaded at least once. by_row: both per index of dim 0 (an expert, for [E, ...]
    expert weights)."""

    def __init__(self, tensor):
        self.tensor, self.loads = tensor, []      # loads: (offsets int64 [n], element size)

    @property
    def bytes(self):
        return sum(o.size * size for o, size in self.loads)

    @property
    def distinct(self):
        return self._distinct_bytes().size

    def _distinct_bytes(self):
        spans = [(o[:, None] + np.arange(size)).ravel() for o, size in self.loads]
        return np.unique(np.concatenate(spans)) if spans else np.zeros(0, np.int64)

    def by_row(self):
        """(bytes, distinct) per index of dim 0: two lists of len(tensor) ints."""
        row = self.tensor.stride(0) * self.tensor.element_size()
        n = self.tensor.shape[0]
        issued = np.zeros(n, np.int64)
        for o, size in self.loads:
            issued += np.bincount(o // row, minlength=n)[:n] * size
        distinct = np.bincount(self._distinct_bytes() // row, minlength=n)[:n]
        return issued.tolist(), distinct.tolist()


@contextlib.contextmanager
def count_reads(tensors):
    """Count the loads of every Triton launch inside the block, run by the CPU interpreter
    (TRITON_INTERPRET=1), that fall inside each of `tensors` (name -> contiguous CPU tensor):
    yields name -> Reads, filled as the kernels run. Every tl.load, masked or not, through a
    block pointer or a descriptor too, reaches the interpreter's InterpreterBuilder.
    create_masked_load with the numpy array of its element addresses and its mask; the wrapper
    keeps the mask-true addresses in [data_ptr, data_ptr + numel * element_size) of each tensor.
    The interpreter runs a launch on the tensors' own storage (on the CPU it copies nothing), so
    the addresses are the tensors'. Fails, naming what is missing, where that entry point is not
    found or the interpreter is off."""
    if not kernels.common.interpreting():
        raise AssertionError("count_reads counts loads in Triton's CPU interpreter, which is off "
                             "(TRITON_INTERPRET=1 must be set before triton is imported)")
    try:
        from triton.runtime.interpreter import InterpreterBuilder
        load = InterpreterBuilder.create_masked_load
    except (ImportError, AttributeError) as e:
        raise AssertionError("count_reads wraps triton.runtime.interpreter.InterpreterBuilder."
                             f"create_masked_load, which this Triton lacks: {e!r}") from e
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"count_reads: {name} must be a contiguous CPU tensor")
    reads = {name: Reads(t) for name, t in tensors.items()}
    ranges = [(r, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
              for r, t in zip(reads.values(), tensors.values())]

    def counted(self, ptrs, mask, *args, **kw):
        out = load(self, ptrs, mask, *args, **kw)
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64)
        for r, lo, hi in ranges:
            inside = addresses[(addresses >= lo) & (addresses < hi)]
            if inside.size:
                r.loads.append((inside - lo, out.data.itemsize))
        return out

    InterpreterBuilder.create_masked_load = counted
    try:
        yield reads
    finally:
        InterpreterBuilder.create_masked_load = load


# ---------------------------------------------------------------------------------------------
# The kernels compiled for sm_90 on a machine without a GPU

SM90 = ("cuda", 90, 32)   # Triton's GPUTarget: backend, capability, warp size


@contextlib.contextmanager
def recorded_launches():
    """Each Triton launch of the kernels package under the CPU interpreter while the block runs,
    recorded as a JSON-able spec: the kernel (module, name), each argument (its type as Triton's
    launcher names it, and a number's or string's value; a triton.language dtype by its name),
    whether a pointer or int is a multiple of 16 (the launcher compiles a kernel specialized on
    that: wider loads, cp.async) and num_warps / num_stages. Yields the list of specs, one per
    distinct launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type
    specs, real = [], InterpretedFunction.run

    def arg(v):   # Triton's own signature type ("*bf16", "i32", ...) beside a value to keep
        if isinstance(v, torch.Tensor):
            return {"type": mangle_type(v), "div16": v.data_ptr() % 16 == 0}
        if isinstance(v, (bool, int, float)):
            return {"value": v, "type": mangle_type(v),
                    "div16": type(v) is int and v % 16 == 0}
        if v is None or isinstance(v, str):
            return {"value": v}
        return {"tl_dtype": v.name}                       # a triton.language dtype: "bf16", ...

    def run(self, *args, grid, warmup, **kw):
        if self.fn.__module__.startswith("kernels."):
            params = dict(zip(self.arg_names, args), **{
                k: v for k, v in kw.items() if k in self.arg_names})
            spec = {"module": self.fn.__module__, "name": self.fn.__name__,
                    "args": {k: arg(v) for k, v in params.items()},
                    "options": {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}}
            if spec not in specs:
                specs.append(spec)
        return real(self, *args, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = real


def compile_launches(path):
    """Compile each launch spec of the JSON file at `path` (recorded_launches') for sm_90 with
    Triton's own compiler, no GPU needed (run without TRITON_INTERPRET), as a Hopper GPU runs
    them: with programmatic dependent launch's wait (common.GDC). Each kernel's PTX must then hold
    the wait, no global memory access before it in the text's order, and the prefetch there where
    its launch asked for one (PREFETCH > 0; _before_wait). Prints one line a spec; raises on the
    first that fails."""
    for spec in json.load(open(path)):
        compiled, consts = compile_spec(spec)
        problem = _before_wait(compiled.asm["ptx"], (consts.get("PREFETCH") or 0) > 0)
        if problem:
            raise AssertionError(f"{spec['module']}.{spec['name']}: {problem}")
        print("compiled", spec["module"], spec["name"], flush=True)


def matrix_moves(path):
    """Compile each launch spec of the JSON file at `path` for sm_90 (as compile_launches) and
    print, a line a spec, its name and how many ldmatrix and stmatrix instructions its PTX holds:
    the moves of an MMA operand made in registers through shared memory."""
    for spec in json.load(open(path)):
        ptx = compile_spec(spec)[0].asm["ptx"]
        print(spec["name"], len(re.findall(r"\bldmatrix\.", ptx)),
              len(re.findall(r"\bstmatrix\.", ptx)), flush=True)


def compile_spec(spec):
    """One launch spec (recorded_launches') compiled for sm_90 by Triton's own compiler, with
    programmatic dependent launch's wait: the CompiledKernel (its asm: ttgir, ptx, cubin) and
    the constexpr values it was specialized on, by name."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    kernels.common.GDC = triton.language.constexpr(True)
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        a = spec["args"].get(p.name, {"value": p.default if p.has_default else None})
        if p.is_constexpr or "type" not in a:                  # None passes as a constexpr
            v = triton.language.dtype(a["tl_dtype"]) if "tl_dtype" in a else a.get("value")
            sig[p.name], consts[p.name] = "constexpr", v
        else:
            sig[p.name] = a["type"]
            if a.get("div16"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget(*SM90), options=spec["options"]), consts


# a PTX instruction that reads or writes global memory, whatever qualifiers come before .global
# (ld.volatile.global, atom.release.gpu.global, ...; a prefetch does neither, nor a .param line)
GLOBAL_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|ldu|st|atom|red|multimem|cp)\.[\w.:]*\bglobal\b"
                           r"|\bcp\.async\.(ca|cg)\b|\bcp\.(reduce\.)?async\.bulk\.(?!prefetch)")


def _before_wait(ptx, prefetch):
    """What breaks the rule of programmatic dependent launch (kernels/common.py) in a kernel's
    PTX, in the text's order: no griddepcontrol.wait, a global memory access before the first one,
    or (prefetch) no prefetch.global.L2 before it. None where nothing does."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return "no griddepcontrol.wait"
    early = [line.strip() for line in lines[:wait] if GLOBAL_ACCESS.search(line)]
    if early:
        return f"global memory accessed before the wait: {early[:3]}"
    if prefetch and not any("prefetch.global.L2" in line for line in lines[:wait]):
        return "no prefetch before the wait"
    return None
