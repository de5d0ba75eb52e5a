"""Routing for timing: SIMULATED distinct experts, recorded routing replayed, and a router probe.

The cost of a verify of T tokens is mostly the routed experts it reads, so it turns on how many
distinct experts its T x top_k choices reach on a rank. Besides the router's own choice
(model.Router) and SIMULATED uniform routing (Router.uniform_choice), this module gives two more
choices for timing, each a LongTensor of ids [N, top_k] that replaces the router's ids:

  distinct  SIMULATED: the N x top_k choices of a forward drawn from exactly D experts
            (distinct_ids, DistinctChoice); D = top_k ... min(N x top_k, experts) spans the best
            case (every token the same experts) to uniform's worst one (uniform_distinct gives
            uniform's expectation for tokens drawn independently).
  trace     TRACE: recorded ids replayed in order (TraceCursor): a decode step takes the next
            token's experts, a verify of T tokens the next T tokens', cycling through the trace.

Routing trace format: one .npz (numpy.savez_compressed; save_trace writes it, read_trace reads it)
  routing_ids       int16 or int32 [layers, tokens, top_k]: the routed expert ids, 0 ... n_experts
                    - 1, each row a token's top_k choices in the router's order; layers are the MoE
                    layers in model order (dense layers left out); tokens in the order they ran
                    (the rows of a batch one after another, each row's tokens in order).
  n_experts         int scalar: routed experts of the model that ran (all of them, not a rank's).
  top_k             int scalar: experts per token.
  sequence_lengths  optional int64 [S]: the tokens are S sequences of these lengths, one after
                    another (windows that should not cross a sequence's end use it).
  note              optional str: what recorded it (model, text), for labels.
read_trace refuses, in one line, a trace whose n_experts or top_k is not the model's.

SGLang's expert-distribution recorder (python/sglang/srt/eplb/expert_distribution.py; earlier
srt/managers/) in its "per_token" mode (--expert-distribution-recorder-mode per_token, then the
/start_expert_distribution_record, /stop_... and /dump_expert_distribution_record endpoints)
writes one torch.save file per rank, expert_distribution_recorder_{time}_{rank}.pt (in
SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR): a dict with "records", one dict per forward pass
("topk_ids_of_layer" int32 [all layers, tokens of the pass, 8], -1 where a layer routed nothing
(a dense layer) or a slot was unused; "input_ids", "positions", "extend_seq_lens",
"forward_mode", ...), and "last_physical_to_logical_map" int [all layers, physical experts].
Its ids are physical (after EPLB's logical -> physical map; equal to the logical ones without
redundant experts). read_sglang turns such files into our trace: ids mapped back to logical
experts, the layers that routed nothing dropped, tokens in the recorder's order (pass by pass,
each pass's tokens in order). Record one request at a time
(--max-running-requests 1) to get a text's tokens in order; a batched server interleaves requests
within a pass, and neighbouring tokens in the trace are then a batch's neighbours. ("stat" mode
keeps only per-expert counts: no trace in it.)

The figure (`python routing.py plot RESULT.json [...] --out FIG.png`): verify's cost in decode
steps against D, and the break-even accepted length beside it, from run.py --distinct-sweep
--json files, one series each (matplotlib, imported there only: not a requirement).

The probe (`python routing.py probe --out DIR`): a small model (model.Transformer) whose MoE
layers route as Kimi-K2 does (384 routed experts, top 8, sigmoid scores, the aux-free correction
bias moved by the sign of each expert's load as DeepSeek-V3 does, n_group 1, one shared expert,
routed scaling 2.827), trained on Python standard library bytes (train.py's corpus), then its
routing recorded on held-out text: a small trained model's routing at Kimi-K2's expert count, not
Kimi-K2's. It writes the trace, the distinct-expert curve against uniform's and the load spread.
"""
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

import baseline
import model


# ---------------------------------------------------------------------------------------------
# SIMULATED distinct experts

def uniform_distinct(n, k, T):
    """Expected distinct experts of T tokens each choosing k of n uniformly and independently:
    n (1 - (1 - k/n)^T) (an expert escapes one token with probability 1 - k/n)."""
    return n * (1 - (1 - k / n) ** T)


def distinct_range(tokens, top_k, n_experts):
    """The distinct-expert counts a forward of `tokens` tokens can reach: (low, high)."""
    return top_k, min(tokens * top_k, n_experts)


def distinct_ids(tokens, top_k, distinct, n_experts, generator=None):
    """LongTensor [tokens, top_k] on the host: each row top_k different experts, all rows together
    exactly `distinct` experts, each used ceil or floor of tokens x top_k / distinct times. Pair j
    = n top_k + i of the tokens x top_k pairs takes slot j mod distinct (top_k consecutive slots
    differ while top_k <= distinct, and every slot is reached while distinct <= tokens x top_k);
    slot s is expert experts[s], where experts is the first `distinct` of a permutation drawn from
    `generator` (None: experts 0 ... distinct - 1, so that distinct = min(tokens x top_k,
    n_experts) is model.Router's uniform choice)."""
    low, high = distinct_range(tokens, top_k, n_experts)
    if not low <= distinct <= high:
        raise ValueError(f"distinct experts {distinct} outside [{low}, {high}] for {tokens} tokens "
                         f"x top-{top_k} of {n_experts} experts")
    if generator is None:
        experts = torch.arange(distinct)
    else:
        experts = torch.randperm(n_experts, generator=generator)[:distinct]
    slots = torch.arange(tokens * top_k).view(tokens, top_k) % distinct
    return experts[slots]


def sweep_points(tokens, top_k, n_experts):
    """The D of run.py --distinct-sweep: top_k times 1, 1.5, 2, 3, 4, 6, 8, ... (each doubling
    and the point half-way to the next), below min(tokens x top_k, n_experts), which closes the
    list (uniform routing's count there). 4 tokens, top 8, 128 experts: 8, 12, 16, 24, 32."""
    high = distinct_range(tokens, top_k, n_experts)[1]
    points, m = [], 1
    while m * top_k < high:
        points += [D for D in (m * top_k, m * top_k * 3 // 2) if D < high]
        m *= 2
    return points + [high]


class DistinctChoice:
    """routing "distinct" for the routers of a model (model.Transformer.set_routing): (layer, ids
    [N, K]) -> the same shape drawn from D experts (distinct_ids; every layer the same), D clipped
    to what N tokens reach (a decode step of one token keeps top_k). Each shape's ids are built
    on the host once, copied to ids' device once and kept, so the first call of a shape must
    come before a CUDA graph captures it (a warm-up); later calls return the kept tensor and
    sync nothing."""

    def __init__(self, distinct, n_experts, top_k, seed=0):
        if not top_k <= distinct <= n_experts:
            raise ValueError(f"--distinct-experts {distinct} outside [{top_k}, {n_experts}] "
                             f"(top-{top_k} of {n_experts} experts on the rank)")
        self.distinct, self.n_experts, self.top_k, self.seed = distinct, n_experts, top_k, seed
        self.kept = {}

    def distinct_for(self, tokens):
        return min(self.distinct, tokens * self.top_k)

    def __call__(self, layer, ids):
        key = (ids.shape[0], ids.device)
        if key not in self.kept:
            g = torch.Generator().manual_seed(self.seed)
            choice = distinct_ids(ids.shape[0], self.top_k, self.distinct_for(ids.shape[0]),
                                  self.n_experts, g)
            self.kept[key] = choice.to(ids.device)
        return self.kept[key]


# ---------------------------------------------------------------------------------------------
# Routing traces

def save_trace(path, ids, n_experts, top_k, sequence_lengths=None, note=""):
    """Write ids [layers, tokens, top_k] as a routing trace (the module docstring's format) at
    `path` as given, making its folder where missing."""
    ids = torch.as_tensor(ids)
    check_ids(ids, n_experts, top_k, path)
    dtype = np.int16 if n_experts <= np.iinfo(np.int16).max else np.int32
    extra = {} if sequence_lengths is None else dict(
        sequence_lengths=np.asarray(sequence_lengths, dtype=np.int64))
    arrays = dict(routing_ids=ids.numpy().astype(dtype), n_experts=np.int64(n_experts),
                  top_k=np.int64(top_k), note=np.str_(note), **extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # on a file, not a name (a name would gain ".npz"); whole or not at all
    baseline.write_whole(path, lambda f: np.savez_compressed(f, **arrays))


def check_ids(ids, n_experts, top_k, what):
    if ids.dim() != 3 or ids.shape[-1] != top_k:
        raise ValueError(f"{what}: routing ids {list(ids.shape)} are not [layers, tokens, {top_k}]")
    if ids.numel() and (ids.min() < 0 or ids.max() >= n_experts):
        raise ValueError(f"{what}: expert ids {int(ids.min())} ... {int(ids.max())} outside "
                         f"0 ... {n_experts - 1}")


class Trace:
    """A routing trace read back: ids LongTensor [layers, tokens, top_k] and its metadata."""

    def __init__(self, ids, n_experts, top_k, sequence_lengths=None, note=""):
        self.ids, self.n_experts, self.top_k = ids, n_experts, top_k
        self.sequence_lengths, self.note = sequence_lengths, note


def read_trace(path, n_experts, top_k):
    """A routing trace (.npz) as a Trace, refused in one line (ValueError) when it is no .npz or
    its expert count or top-k is not the model's."""
    baseline.check_npz(path)
    with np.load(path) as f:
        have_e, have_k = int(f["n_experts"]), int(f["top_k"])
        if (have_e, have_k) != (n_experts, top_k):
            raise ValueError(f"routing trace {path}: {have_e} experts, top-{have_k}; the model "
                             f"routes top-{top_k} of {n_experts}")
        ids = torch.from_numpy(f["routing_ids"].astype(np.int64))
        lengths = f["sequence_lengths"].tolist() if "sequence_lengths" in f else None
        note = str(f["note"]) if "note" in f else ""
    check_ids(ids, n_experts, top_k, path)
    return Trace(ids, n_experts, top_k, lengths, note)


def check_run(cfg, margs):
    """run.py's --routing flags against the model's sizes, before anything is built (ValueError,
    one line each): --distinct-experts within distinct_range of the largest verify; a
    --routing-trace whose experts and top-k are the model's (its full expert count, before
    --routed-experts: the preset's for random weights)."""
    E, K = margs.n_routed_experts, margs.num_experts_per_tok
    tokens = cfg.batch_size * max(cfg.speculative_num_draft_tokens, cfg.speculative_num_steps + 1)
    if cfg.routing == "distinct":
        low, high = distinct_range(tokens, K, E)
        if not low <= cfg.distinct_experts <= high:
            raise ValueError(f"--distinct-experts {cfg.distinct_experts}: must lie in [{low}, "
                             f"{high}] (top-{K}; a verify of {tokens} tokens x top-{K} on {E} "
                             "experts)")
    if cfg.routing != "trace":
        return
    import checkpoint
    full = E if cfg.model_path else checkpoint.preset(cfg.preset).n_routed_experts
    try:
        baseline.check_npz(cfg.routing_trace)   # ("PATH is not an .npz file ...")
    except ValueError as e:
        raise ValueError(f"--routing-trace {e}") from None
    try:
        with np.load(cfg.routing_trace) as f:
            have_e, have_k, shape = int(f["n_experts"]), int(f["top_k"]), f["routing_ids"].shape
    except (OSError, KeyError, ValueError) as e:
        why = f"not a routing trace ({e})"
        raise ValueError(f"--routing-trace {cfg.routing_trace}: {why}") from None
    if (have_e, have_k) != (full, K):
        raise ValueError(f"--routing-trace {cfg.routing_trace}: {have_e} experts, top-{have_k}; "
                         f"the model routes top-{K} of {full}")
    if len(shape) != 3 or shape[1] < 1:
        raise ValueError(f"--routing-trace {cfg.routing_trace}: routing_ids {list(shape)} are not "
                         "[layers, tokens, top_k]")


class TraceCursor:
    """Hands out a trace's tokens in order, cycling: take(n) -> ids [layers, n, top_k], the next n
    tokens (a decode step of B rows takes B, a verify of B x T tokens takes B x T, rows one
    after another, as the router sees them flattened). layers: how many MoE layers the model has;
    its layer l replays the trace's layer l mod (the trace's layers). onto: experts on the rank,
    when fewer than the trace's: each take's experts are renamed, layer by layer, onto 0 ... D -1
    in order of their ids (which tokens share an expert is kept, so the distinct count and each
    expert's load are; refused where D > onto, unless saturate: such a layer's window then
    reaches all the rank's experts, its pairs spread over them as uniform routing spreads them,
    pair j of the window to expert j mod onto). Host tensors; the caller copies them to the
    device buffer its router reads."""

    def __init__(self, ids, layers=None, onto=None, saturate=False):
        layers = layers or ids.shape[0]
        self.ids = ids[torch.arange(layers) % ids.shape[0]]
        self.onto, self.saturate, self.at = onto, saturate, 0

    def take(self, n):
        tokens = self.ids.shape[1]
        index = (self.at + torch.arange(n)) % tokens
        self.at = (self.at + n) % tokens
        ids = self.ids[:, index]
        return ids if self.onto is None else rename(ids, self.onto, self.saturate)


class TraceChoice:
    """routing "trace" for the routers of a model (model.Transformer.set_routing): advance(n)
    copies the cursor's next n tokens into a device buffer kept for n (one host-to-device copy a
    forward, made before a graph's replay, outside it); choice(layer, ids), or calling it, is then
    that buffer's layer [N, K], the same tensor every time, so a captured graph reads what the
    last advance wrote. A forward of a size never advanced (a prefill) keeps the router's own
    ids. On a GPU the copy goes through pinned memory, asynchronously; the next advance of the
    same size first waits until that copy has read it (the host stays a forward ahead)."""

    def __init__(self, cursor, device):
        self.cursor, self.device, self.kept = cursor, torch.device(device), {}
        self.staged, self.copied = {}, {}
        self.advanced = 0          # tokens handed out

    def advance(self, n):
        ids = self.cursor.take(n)
        cuda = self.device.type == "cuda"
        if n not in self.kept:
            self.kept[n] = torch.empty_like(ids, device=self.device)
            self.staged[n] = ids.pin_memory() if cuda else ids.clone()
        elif self.copied.get(n) is not None:
            self.copied[n].synchronize()
        self.staged[n].copy_(ids)
        self.kept[n].copy_(self.staged[n], non_blocking=cuda)
        if cuda:
            self.copied[n] = torch.cuda.Event()
            self.copied[n].record()
        self.advanced += n

    def choice(self, layer, ids):
        kept = self.kept.get(ids.shape[0])
        return ids if kept is None else kept[layer]

    __call__ = choice


def rename(ids, n_experts, saturate=False):
    """ids [layers, n, K]: each layer's distinct experts renamed onto 0 ... D - 1 (sorted); where
    D > n_experts, refused, or with saturate pair j to expert j mod n_experts (TraceCursor)."""
    out = torch.empty_like(ids)
    for layer, layer_ids in enumerate(ids):
        used, renamed = layer_ids.unique(return_inverse=True)
        if len(used) > n_experts and not saturate:
            raise ValueError(f"a window of the trace reaches {len(used)} experts in layer {layer}; "
                             f"the rank has {n_experts}")
        out[layer] = (renamed if len(used) <= n_experts else
                      torch.arange(renamed.numel()).view_as(renamed) % n_experts)
    return out


def read_sglang(paths, n_experts, top_k):
    """SGLang expert-distribution recorder files in "per_token" mode (one path or several, read in
    order) as a Trace: ids mapped to logical experts by each file's last_physical_to_logical_map
    (where it has one), the layers that routed no token dropped, tokens whose ids hold an unused
    slot (-1) in a routed layer dropped. Refused in one line where the ids are not top_k wide or
    reach past n_experts, or where no token is left."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    passes, lengths = [], []
    for path in paths:
        try:
            dump = torch.load(path, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as e:   # foreign bytes fail in the unpickler in many ways
            why = (str(e).strip().splitlines() or [""])[0][:100]
            raise ValueError(f"{path}: torch.load cannot read it ({type(e).__name__}: {why})") \
                from None
        if not isinstance(dump, dict) or "records" not in dump:
            raise ValueError(f"{path}: not an SGLang expert-distribution dump in per_token mode "
                             "(no 'records'; stat mode keeps only counts)")
        to_logical = dump.get("last_physical_to_logical_map")
        for i, record in enumerate(dump["records"]):
            if not isinstance(record, dict) or "topk_ids_of_layer" not in record:
                raise ValueError(f"{path}: its records hold no per-token ids (per_pass or stat "
                                 "mode); record with SGLang's per_token mode")
            ids = record_ids(path, i, record["topk_ids_of_layer"])  # [all layers, tokens, width]
            if ids.shape[-1] != top_k:
                raise ValueError(f"{path}: recorded ids are top-{ids.shape[-1]}; the model routes "
                                 f"top-{top_k}")
            if to_logical is not None:
                table = torch.as_tensor(to_logical).long()
                if table.max() + 1 != n_experts:
                    raise ValueError(f"{path}: its experts map onto {int(table.max()) + 1} "
                                     f"logical experts; the model has {n_experts}")
                logical = table.gather(1, ids.clamp(min=0).flatten(1)).view_as(ids)
                ids = torch.where(ids >= 0, logical, ids)
            passes.append(ids)
            lengths.append(ids.shape[1])
    if not passes:
        raise ValueError(f"{', '.join(map(str, paths))}: no forward pass recorded")
    ids = torch.cat(passes, dim=1)
    ids = ids[(ids >= 0).any(-1).any(-1)]                         # the layers that routed
    whole = (ids >= 0).all(-1).all(0)                             # tokens with every slot used
    ids = ids[:, whole]
    if not ids.numel():
        raise ValueError(f"{', '.join(map(str, paths))}: no token routed in every slot of a layer "
                         "(every id -1, or each token with an unused slot): an empty trace")
    if ids.max() >= n_experts:
        raise ValueError(f"{paths[0]}: expert ids reach {int(ids.max())}; the model has "
                         f"{n_experts} experts")
    note = f"SGLang per_token dump, {len(lengths)} forward passes, {len(paths)} file(s)"
    return Trace(ids, n_experts, top_k, None, note)


def record_ids(path, i, ids):
    """A record's topk_ids_of_layer as a LongTensor, refused in one line (ValueError naming the
    file, the record and what it holds) unless an integer tensor [layers, tokens, K]."""
    what = f"{path}: record {i}'s topk_ids_of_layer"
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what} is a {type(ids).__name__}, not a tensor [layers, tokens, K]")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{what} is {ids.dtype}, not integers")
    if ids.dim() != 3:
        raise ValueError(f"{what} has shape {list(ids.shape)}, not [layers, tokens, K]")
    return ids.long()


# ---------------------------------------------------------------------------------------------
# Distinct experts of windows of consecutive tokens

def distinct_curve(ids, n_experts, max_T, sequence_lengths=None):
    """Mean distinct experts a layer over every window of T consecutive tokens inside one
    sequence, for T = 1 ... max_T: {T: float}. ids [layers, tokens, K]."""
    lengths = sequence_lengths or [ids.shape[1]]
    sums, counts = [0.0] * (max_T + 1), [0] * (max_T + 1)
    start = 0
    for n in lengths:
        for seq in ids[:, start:start + n]:                         # one layer's [n, K]
            hit = torch.zeros(n, n_experts, dtype=torch.int32).scatter_(1, seq, 1)
            cum = F.pad(hit.cumsum(0), (0, 0, 1, 0))                # [n + 1, E]
            for T in range(1, min(max_T, n) + 1):
                present = (cum[T:] - cum[:-T]) > 0                  # [n - T + 1, E]
                sums[T] += present.sum().item()
                counts[T] += present.shape[0]
        start += n
    return {T: sums[T] / counts[T] for T in range(1, max_T + 1) if counts[T]}


def load_spread(ids, n_experts):
    """Each layer's expert load (tokens routed to each expert) summarized: max/min and the
    coefficient of variation (std/mean), per layer and their mean."""
    layers = []
    for layer_ids in ids:
        load = torch.bincount(layer_ids.flatten(), minlength=n_experts).double()
        layers.append(dict(max_over_min=(load.max() / load.min()).item() if load.min() > 0
                           else None, cv=(load.std() / load.mean()).item(),
                           unused=int((load == 0).sum())))
    mean = {k: mean_or_none([d[k] for d in layers]) for k in ("max_over_min", "cv", "unused")}
    return dict(layers=layers, mean=mean)


def mean_or_none(values):
    """The mean, or None where a value is None (max/min with an unused expert)."""
    return None if None in values else sum(values) / len(values)


# ---------------------------------------------------------------------------------------------
# The router probe: a small model with Kimi-K2's routing, trained on stdlib bytes

KIMI_ROUTING = ("n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "n_group",
                "topk_group", "norm_topk_prob", "n_shared_experts", "scoring_func", "topk_method")
PROBE_SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=512,
                   moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1,
                   num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# bias_rate: DeepSeek-V3's gamma, the bias's step a batch, at the peak of the learning rate's
# schedule, which it follows (warm-up, then cosine decay to a tenth). DeepSeek-V3 keeps 0.001
# over trillions of tokens; here the load must balance within a few hundred batches, then
# settle: a step much wider than the gap between a token's 8th and 9th biased scores swings the
# load from batch to batch. router_lr_scale: the routers' weights learn at this fraction of the
# learning rate. Adam moves each weight by about the rate a step, so at the full rate a logit over
# 256 normalized inputs can move by tenths a step, faster than a bias step that still settles:
# a third of the experts or more go unused within 50 batches, and the load does not balance
# within the run.
PROBE_TRAIN = dict(steps=600, batch=16, seq_len=128, lr=3e-3, warmup=30, seed=0, bias_rate=0.01,
                   router_lr_scale=0.1)
PROBE_QUICK = dict(PROBE_TRAIN, steps=20)
PROBE_RECORD = dict(sequences=64, seq_len=128, max_T=16)
PROBE_FILES = ("probe_trace.npz", "probe.json", "probe.md")   # what the probe writes
# the committed probe's folder
PROBE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "routing")


def probe_args():
    """ModelArgs: PROBE_SHAPE elsewhere, Kimi-K2's routing (the kimi-k2 preset's values)."""
    import checkpoint
    kimi = checkpoint.preset("kimi-k2")
    return model.ModelArgs(**PROBE_SHAPE, **{k: getattr(kimi, k) for k in KIMI_ROUTING})


def routers(target):
    return [layer.mlp.gate for layer in target.layers if isinstance(layer.mlp, model.MoE)]


class RoutingRecorder:
    """Forward hooks on a model's routers: each call's ids, per MoE layer, kept on the host."""

    def __init__(self, target):
        self.ids = [[] for _ in routers(target)]
        self.hooks = [r.register_forward_hook(self.hook(i)) for i, r in enumerate(routers(target))]

    def hook(self, layer):
        def keep(router, inputs, out):  # (a fused MoE launch's shared-expert column left out)
            ids = out[0][:, :router.args.num_experts_per_tok]   # a copy: a choice's is reused
            self.ids[layer].append(ids.detach().to("cpu", copy=True))
        return keep

    def pop(self):
        """ids [layers, tokens, K] of the calls since the last pop."""
        out = torch.stack([torch.cat(calls) for calls in self.ids])
        self.ids = [[] for _ in self.ids]
        return out

    def remove(self):
        for h in self.hooks:
            h.remove()


def balance_bias(target, ids, rate):
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's correction bias moves by `rate`
    towards balance, up where its load of the batch is under the mean, down where over."""
    for router, layer_ids in zip(routers(target), ids):
        load = torch.bincount(layer_ids.flatten(), minlength=router.args.n_routed_experts).float()
        router.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))


def train_probe(cfg, data, minutes=None):
    """The probe trained by next-byte cross-entropy (AdamW, train.py's schedule; grouped experts),
    its correction bias balanced after each step (balance_bias, its rate scheduled as the
    learning rate); stops early past `minutes`, and at a Ctrl-C that train.ctrl_c_noted noted
    (KeyboardInterrupt, between steps). Returns (target, each step's load spread)."""
    import checkpoint
    import kernels
    import train
    from tqdm import tqdm
    args = probe_args()
    target = model.Transformer(args, cfg["batch"], cfg["seq_len"], dtype=torch.float32)
    checkpoint.init_random(target, cfg["seed"])
    kernels.accelerate(target, moe="grouped")
    for router in routers(target):
        router.e_score_correction_bias.zero_()
    named = [(n, p) for n, p in target.named_parameters() if not n.endswith("correction_bias")]
    groups = [dict(params=require_grad([p for n, p in named if n.endswith("gate.weight") == r]),
                   scale=cfg["router_lr_scale"] if r else 1.0) for r in (False, True)]
    opt = torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    positions = torch.arange(cfg["seq_len"]).expand(cfg["batch"], cfg["seq_len"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    recorder, history, start = RoutingRecorder(target), [], time.time()
    with tqdm(range(cfg["steps"]), desc="router probe") as bar:   # closed at a Ctrl-C too
        for step in bar:
            train.check_ctrl_c()
            if minutes and time.time() - start > 60 * minutes:
                break
            lr = train.lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr * group["scale"]
            train.detach_caches(target)
            x = train.windows(data, cfg["batch"], cfg["seq_len"] + 1, gen)
            loss = F.cross_entropy(target(x[:, :-1], positions).logits.flatten(0, 1),
                                   x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ids = recorder.pop()
            with torch.no_grad():
                balance_bias(target, ids, cfg["bias_rate"] * lr / cfg["lr"])
            history.append(load_spread(ids, args.n_routed_experts)["mean"] | dict(loss=loss.item()))
            bar.set_postfix_str(f"loss {loss.item():.3f} load cv {history[-1]['cv']:.2f} "
                                f"unused {history[-1]['unused']:.0f}")
    recorder.remove()
    for p in target.parameters():
        p.requires_grad_(False)
    train.detach_caches(target)
    return target, history


def require_grad(params):
    """params, set to require grad (the project builds them frozen)."""
    for p in params:
        p.requires_grad_(True)
    return params


def heldout_windows(n, length):
    """n windows of `length` held-out bytes (train.HELDOUT_FILES), evenly spaced: [n, length]."""
    import train
    text = train.corpus(train.HELDOUT_FILES)
    starts = torch.linspace(0, len(text) - length - 1, n).long()
    return text[starts.unsqueeze(1) + torch.arange(length)].long()


def record_routing(target, tokens):
    """The routers' ids over held-out windows tokens [S, L], one window a forward (batch rows are
    then not mixed): ids [MoE layers, S x L, K], windows one after another."""
    recorder = RoutingRecorder(target)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        for row in tokens:
            target(row.unsqueeze(0), positions)
    ids = recorder.pop()
    recorder.remove()
    return ids


def tiny_pair_ids(tokens):
    """The committed tiny pair's target (train.py) routed over the same windows, or None."""
    import checkpoint
    import train
    if not os.path.isdir(train.TARGET_DIR):
        return None
    target = checkpoint.load_target(train.TARGET_DIR, 1, tokens.shape[1], dtype=torch.float32)
    return target.args, record_routing(target, tokens)


def probe_main(argv):
    """`routing.py probe`: flags and --out checked before any training (one line, status 2);
    Ctrl-C as train.py's: one line, status 130, no file written and the folder it made gone."""
    p = probe_parser()
    a = p.parse_args(argv)
    cfg = probe_config(p, a)
    import train
    try:
        made = train.make_folder(a.out)
    except OSError as e:
        p.error(f"--out {a.out}: cannot write there ({e.strerror or e})")
    torch.set_num_threads(a.threads)
    try:
        with train.ctrl_c_noted():
            print(probe_run(cfg, a))
    except KeyboardInterrupt:
        gone = f", {train.remove_made(made)} removed" if made else f" in {a.out}"
        print(f"routing.py probe: interrupted; nothing written{gone}", file=sys.stderr,
              flush=True)
        return train.INTERRUPTED
    return 0


def probe_parser():
    p = parser("routing.py probe", (
        "Train a small model with Kimi-K2's routing (384 experts, top 8, sigmoid, aux-free bias, "
        "n_group 1, a shared expert, scaling 2.827) on Python stdlib bytes, record its routing on "
        "held-out text, and write DIR/probe_trace.npz, DIR/probe.json and DIR/probe.md: distinct "
        "experts a layer for T = 1..16 against uniform's, the load spread. A small trained "
        "model's routing at Kimi-K2's expert count, not Kimi-K2's."))
    p.add_argument("--out", required=True, help="folder for the trace and the tables")
    p.add_argument("--quick", action="store_true", help=f"{PROBE_QUICK['steps']} training steps "
                   "(a smoke test: the load does not balance)")
    p.add_argument("--steps", type=int, help=f"training steps (default {PROBE_TRAIN['steps']})")
    p.add_argument("--bias-rate", type=float, help="the correction bias's step a batch (0: no "
                   f"correction; default {PROBE_TRAIN['bias_rate']})")
    p.add_argument("--router-lr-scale", type=float, help="the routers' weights' learning rate, "
                   f"a fraction of the rest's (0: frozen routers; default "
                   f"{PROBE_TRAIN['router_lr_scale']})")
    p.add_argument("--minutes", type=float, default=12, help="stop training after this many "
                   "minutes, wherever the schedule is (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: more "
                   "spin on a busy machine)")
    return p


def probe_config(p, a):
    """The training's settings (PROBE_TRAIN, PROBE_QUICK) with the flags given (0 is a value);
    values no probe can use (--threads past the CPUs too, as train.py) refused by the parser,
    naming the flag."""
    import train
    train.check_threads(p, a.threads)
    for flag, value, low in (("--steps", a.steps, 1), ("--bias-rate", a.bias_rate, 0),
                             ("--router-lr-scale", a.router_lr_scale, 0)):
        if value is not None and not low <= value < float("inf"):   # (NaN fails too)
            finite = " and finite" if isinstance(value, float) else ""
            p.error(f"{flag} {value}: must be at least {low}{finite}")
    if not a.minutes > 0:
        p.error(f"--minutes {a.minutes}: must be above 0")
    if a.quick and os.path.realpath(a.out) == os.path.realpath(PROBE_DIR):
        p.error(f"--out {a.out}: --quick would replace the committed probe with a smoke test; "
                "give another --out")
    cfg = dict(PROBE_QUICK if a.quick else PROBE_TRAIN)
    given = dict(steps=a.steps, bias_rate=a.bias_rate, router_lr_scale=a.router_lr_scale)
    cfg.update({k: v for k, v in given.items() if v is not None})
    return cfg


def probe_run(cfg, a):
    """Train the probe, record its routing, write the trace and the tables into a.out (a folder
    that exists); returns probe.md's text."""
    import train
    t0 = time.time()
    target, history = train_probe(cfg, train.corpus(train.TRAIN_FILES), a.minutes)
    minutes = (time.time() - t0) / 60
    args, R = target.args, PROBE_RECORD
    tokens = heldout_windows(R["sequences"], R["seq_len"])
    ids = record_routing(target, tokens)
    lengths = [R["seq_len"]] * R["sequences"]
    result = probe_result(cfg, target, ids, lengths, tokens, history, minutes)
    train.check_ctrl_c()   # the last point a Ctrl-C stops the run: the files are written whole
    E, K = args.n_routed_experts, args.num_experts_per_tok
    work = tempfile.mkdtemp(prefix=".probe-", dir=a.out)   # on --out's file system
    try:
        save_trace(os.path.join(work, "probe_trace.npz"), ids, E, K, lengths,
                   note="router probe: a small trained model's routing at Kimi-K2's expert count "
                        "(384, top 8), held-out Python stdlib bytes; not Kimi-K2's")
        with open(os.path.join(work, "probe.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(work, "probe.md"), "w") as f:
            f.write(probe_markdown(result))
        for name in PROBE_FILES:   # each a rename: no file of --out is ever half written
            os.replace(os.path.join(work, name), os.path.join(a.out, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return probe_markdown(result)


def probe_result(cfg, target, ids, lengths, tokens, history, minutes):
    """What probe.json holds: the run, the load spread, the curve (probe, the same tokens
    shuffled, uniform; the tiny pair's where it is committed)."""
    args = target.args
    E, K, max_T = args.n_routed_experts, args.num_experts_per_tok, PROBE_RECORD["max_T"]
    g = torch.Generator().manual_seed(0)
    shuffled = distinct_curve(ids[:, torch.randperm(ids.shape[1], generator=g)], E, max_T)
    tail = history[-50:]
    out = dict(
        label="A small trained model's routing at Kimi-K2's expert count, not Kimi-K2's",
        command=" ".join(["python routing.py probe"] + sys.argv[2:]),
        train=cfg, steps_run=len(history), minutes=round(minutes, 1),
        threads=torch.get_num_threads(),
        python=sys.version.split()[0], torch=torch.__version__,
        shape={k: getattr(args, k) for k in PROBE_SHAPE} | {k: getattr(args, k)
                                                            for k in KIMI_ROUTING},
        heldout=dict(sequences=len(lengths), seq_len=lengths[0]),
        load_heldout=load_spread(ids, E),
        load_train_last_steps={k: mean_or_none([h[k] for h in tail]) for k in tail[0]},
        load_train_every_50=[h for h in history[::50]],
        bias=[dict(min=b.min().item(), max=b.max().item(), std=b.std().item())
              for b in (r.e_score_correction_bias for r in routers(target))],
        curve={T: dict(probe=v, shuffled=shuffled[T],
                       uniform=uniform_distinct(E, K, T))
               for T, v in distinct_curve(ids, E, max_T, lengths).items()})
    tiny = tiny_pair_ids(tokens)
    if tiny is not None:
        targs, tids = tiny
        te, tk = targs.n_routed_experts, targs.num_experts_per_tok
        out["tiny_pair"] = dict(n_experts=te, top_k=tk, load=load_spread(tids, te)["mean"])
        for T, v in distinct_curve(tids, te, max_T, lengths).items():
            out["curve"][T].update(tiny_pair=v, tiny_uniform=uniform_distinct(te, tk, T))
    return out


def probe_markdown(r):
    s, t = r["shape"], r["train"]
    lines = [
        "# Router probe: distinct experts of T consecutive tokens",
        "",
        f"**{r['label']}.** Layers {s['num_hidden_layers']} (the first dense), hidden "
        f"{s['hidden_size']}, {s['n_routed_experts']} routed experts of intermediate "
        f"{s['moe_intermediate_size']}, top {s['num_experts_per_tok']}, sigmoid scores with the "
        f"aux-free correction bias (DeepSeek-V3's rule; its step {t['bias_rate']} a batch at "
        "the learning rate's peak, scheduled as it; the routers' weights at "
        f"{t['router_lr_scale']} of the learning rate), n_group "
        f"{s['n_group']}, {s['n_shared_experts']} shared expert, routed scaling "
        f"{s['routed_scaling_factor']}; trained {r['steps_run']} steps of {t['batch']} x "
        f"{t['seq_len']} bytes of Python stdlib source ({r['minutes']} min, {r['threads']} CPU "
        f"thread(s), Python {r['python']}, torch {r['torch']}). Routing recorded on "
        f"{r['heldout']['sequences']} held-out windows of {r['heldout']['seq_len']} bytes "
        "(probe_trace.npz); every window of T consecutive bytes inside one, each MoE layer "
        "counted, averaged.",
        "",
        f"Command: `{r['command']}`",
        "",
        "Columns: probe; probe with the held-out tokens shuffled (the same loads, no neighbours: "
        "what reuse comes from popular experts alone); uniform N(1 - (1 - k/N)^T) at N = 384, "
        "k = 8" + ("; the committed tiny pair's target (train.py: 16 experts, top 4, grouped) "
                   "and its uniform. train.py never moves that target's correction bias, so its "
                   "load is lopsided (the load table's CV): its gap below uniform is mostly "
                   "popular experts, not neighbours." if "tiny_pair" in r else "."),
        "",
    ]
    tiny = "tiny_pair" in r
    head = "| T | probe | shuffled | uniform | probe / uniform |" + (
        " tiny pair | tiny uniform |" if tiny else "")
    lines += [head, "|" + "---:|" * (head.count("|") - 1)]
    for T, c in r["curve"].items():
        row = (f"| {T} | {c['probe']:.1f} | {c['shuffled']:.1f} | {c['uniform']:.1f} | "
               f"{c['probe'] / c['uniform']:.2f} |")
        if tiny:
            row += f" {c['tiny_pair']:.1f} | {c['tiny_uniform']:.1f} |"
        lines.append(row)
    held, last = r["load_heldout"], r["load_train_last_steps"]
    lines += ["", "Expert load (tokens routed to each expert, per MoE layer): max/min, "
              "coefficient of variation (std/mean), experts unused.", "",
              "| where | max/min | CV | unused |", "|---|---:|---:|---:|"]
    rows = [(f"held-out, MoE layer {i}", d) for i, d in enumerate(held["layers"])]
    rows.append(("training, last 50 batches (mean of layers)", last))
    if tiny:
        rows.append(("tiny pair, held-out (mean of layers)", r["tiny_pair"]["load"]))
    for where, d in rows:
        spread = "-" if d["max_over_min"] is None else f"{d['max_over_min']:.2f}"
        lines.append(f"| {where} | {spread} | {d['cv']:.3f} | {d['unused']:g} |")
    lines += ["", "The tokens are bytes of Python source, not Kimi-K2's tokens of its own "
              "traffic. Shuffled near uniform's count means a balanced load (no reuse from "
              "popular experts); the gap between the probe and shuffled is what neighbouring "
              "tokens share. max/min \"-\": an expert unused."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line

def parser(prog, description):
    """A command's parser whose refusals are one line and exit status 2, as train.py's."""
    from train import Parser
    return Parser(prog=prog, description=description)


def curve_main(argv):
    p = parser("routing.py curve", "Distinct experts a layer of T consecutive tokens of a routing "
               "trace, against uniform's.")
    p.add_argument("trace", help="a routing trace (.npz: run.py --dump --dump-routing, "
                   "routing.py convert-sglang or probe)")
    p.add_argument("--max-T", type=int, default=16, help="the longest run of consecutive tokens "
                   "(default %(default)s)")
    a = p.parse_args(argv)
    if a.max_T < 1:
        p.error(f"--max-T {a.max_T}: must be at least 1")
    try:
        baseline.check_npz(a.trace)
        with np.load(a.trace) as f:
            E, K = int(f["n_experts"]), int(f["top_k"])
        t = read_trace(a.trace, E, K)
    except ValueError as e:   # no .npz (check_npz), or a trace read_trace refuses
        p.error(str(e))
    except (OSError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        p.error(f"{a.trace}: not a routing trace ({type(e).__name__}: {e})")
    print(f"{a.trace}: {t.ids.shape[0]} layers, {t.ids.shape[1]} tokens, top-{K} of {E}; {t.note}")
    longest = max(t.sequence_lengths or [t.ids.shape[1]])
    if a.max_T > longest:   # (a window never crosses a sequence's end)
        print(f"routing.py curve: note: --max-T {a.max_T} is past the trace's longest sequence "
              f"({longest} tokens); the curve stops at T {longest}", file=sys.stderr)
    for T, v in distinct_curve(t.ids, E, a.max_T, t.sequence_lengths).items():
        print(f"T {T:2d}: {v:6.1f} distinct (uniform {uniform_distinct(E, K, T):6.1f})")


def convert_main(argv):
    p = parser("routing.py convert-sglang", "SGLang expert-distribution dumps (per_token mode) "
               "-> a routing trace.")
    p.add_argument("dumps", nargs="+", help="expert_distribution_recorder_*.pt, read in order: "
                   "one rank's under plain TP (every rank records the same tokens), each "
                   "rank's where DP attention splits the requests")
    p.add_argument("--out", required=True, help="the routing trace to write (an .npz, written "
                   "at this path as given)")
    p.add_argument("--n-experts", type=int, default=384, help="the model's routed experts "
                   "(default %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts a token (default %(default)s)")
    a = p.parse_args(argv)
    if a.n_experts < 1:
        p.error(f"--n-experts {a.n_experts}: must be at least 1")
    if not 1 <= a.top_k <= a.n_experts:
        p.error(f"--top-k {a.top_k}: must lie in [1, {a.n_experts}] (--n-experts)")
    if os.path.isdir(a.out):
        p.error(f"--out {a.out}: cannot write there (is a folder)")
    try:
        t = read_sglang(a.dumps, a.n_experts, a.top_k)
    except (OSError, ValueError) as e:
        p.error(str(e))
    try:
        save_trace(a.out, t.ids, a.n_experts, a.top_k, note=t.note)
    except OSError as e:   # its folder cannot be made (a file on the way) or written
        p.error(f"--out {a.out}: cannot write there ({e.strerror or e})")
    print(f"{a.out}: {t.ids.shape[0]} layers, {t.ids.shape[1]} tokens ({t.note})")


def plot_main(argv):
    p = parser("routing.py plot", "Verify's cost in plain steps (the cost model's) against "
               "distinct experts a MoE layer, and the break-even accepted length beside it, from "
               "run.py --distinct-sweep --json files (one series each); needs matplotlib (not a "
               "requirement).")
    p.add_argument("results", nargs="+", help="run.py --json files with routing_sweep")
    p.add_argument("--out", required=True, help="the figure (.png, .svg, .pdf)")
    a = p.parse_args(argv)
    import report
    try:   # the files first: a bad one is named with or without matplotlib
        runs = [report.read_run(path) for path in a.results]
    except ValueError as e:
        p.error(str(e))
    for path, r in zip(a.results, runs):
        if not r.get("routing_sweep"):
            p.error(f"{path} has no routing_sweep (run.py --distinct-sweep)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("routing.py plot: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    try:
        report.check_figure_out(a.out)
    except ValueError as e:
        p.error(str(e))
    series = [(sweep_label(r), r["routing_sweep"]) for r in runs]
    fig, (cost, even) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for label, s in series:
        D = [q["distinct"] for q in s["points"]]
        line, = cost.plot(D, [plain_steps(q) for q in s["points"]], "o-", label=label)
        even.plot(D, [q["break_even_accept_len"] for q in s["points"]], "o-",
                  color=line.get_color(), label=label)
        run_steps = s["run_verify_ms"] / s["plain_step_ms"]
        cost.plot([s["run_distinct"]], [run_steps], "*", ms=12, color=line.get_color())
        cost.annotate(s["run_routing"], (s["run_distinct"], run_steps), textcoords="offset points",
                      xytext=(6, -12), fontsize=8, color=line.get_color())
    for tau in (2, 3):
        even.axhline(tau, color="grey", lw=0.8, ls=":")
        even.annotate(f"{tau} accepted a cycle", (even.get_xlim()[0], tau), fontsize=8,
                      color="grey", textcoords="offset points", xytext=(4, 3))
    cost.set(xlabel="distinct experts a MoE layer in the verify (D)",
             ylabel="verify cost, plain steps", title="verify / the cost model's plain step")
    even.set(xlabel="distinct experts a MoE layer in the verify (D)",
             ylabel="accepted tokens a cycle to break even",
             title="break-even accepted length (bonus included)")
    for ax in (cost, even):
        ax.grid(alpha=0.3)
    cost.legend(fontsize=8)
    fig.suptitle("SIMULATED distinct experts (run.py --distinct-sweep); star: the run's own "
                 "routing", fontsize=9)
    fig.tight_layout()
    try:
        report.save_figure(fig, a.out)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {a.out}")
    return 0


def plain_steps(point):
    """A routing_sweep point's verify over the cost model's plain step (files written before the
    key was plain_steps call it decode_steps)."""
    return point["plain_steps"] if "plain_steps" in point else point["decode_steps"]


def sweep_label(r):
    """A series' name: dtype and expert layout, experts, the verify's tokens, graphs."""
    env, s = r["env"], r["routing_sweep"]
    quant = " INT4" if env.get("int4_group_size") else " FP8" if env.get("fp8_block") else ""
    return (f"{env['dtype']}{quant}, {s['experts']} experts, top-{s['top_k']}, verify of "
            f"{s['tokens']}, {s['variant']}")


COMMANDS = dict(probe=probe_main, curve=curve_main, plot=plot_main,
                **{"convert-sglang": convert_main})


COMMAND_HELP = dict(
    probe="train a small model that routes as Kimi-K2 does; record its routing (a trace)",
    curve="distinct experts against tokens: a trace's curve beside uniform routing's",
    plot="verify's cost against distinct experts, from run.py --distinct-sweep --json files",
    **{"convert-sglang": "SGLang's expert-distribution recorder dumps -> a routing trace"})


def main(argv=None):
    """`python routing.py COMMAND ...`: the command's own parser takes the rest (COMMAND --help);
    --help alone lists the commands; no command or an unknown one is refused (status 2); stdout
    closed early (`| head -1`), quiet and exit status 141 (baseline.closed_stdout)."""
    try:
        status = command(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()   # a closed pipe found here, not in the flush at exit
        return status
    except BrokenPipeError:
        return baseline.closed_stdout()


def command(argv):
    """The command argv names, run; its exit status."""
    if not argv or argv[0] not in COMMANDS:
        usage = "usage: python routing.py {" + ",".join(COMMANDS) + "} [--help]"
        if argv[:1] in (["-h"], ["--help"]):
            listed = "\n".join(f"  {name:<15} {COMMAND_HELP[name]}" for name in COMMANDS)
            print(f"{usage}\n\n{__doc__.split(chr(10))[0]}\n\ncommands:\n{listed}")
            return 0
        why = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"{usage}\nrouting.py: error: {why}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
