"""The tiny trained pair: a tiny Kimi-K2-architecture target and its EAGLE-3 head, made in minutes
on a CPU.

    python train.py                  # train both (~5 CPU minutes), save them to out/tiny-stdlib,
                                     # measure
    python train.py --out DIR        # ... save them to DIR instead
    python train.py --quick          # a quick try of every step (seconds of training; a poor pair)
    python train.py --eval [DIR]     # only measure a saved pair (default the committed one),
                                     # print it
    python train.py --out DIR --eval # ... the pair in DIR
    python train.py --out checkpoints/tiny-stdlib --overwrite-committed   # remake the committed
                                                                          # pair

Training runs on one CPU thread (--threads): the sums' order then does not depend on the thread
count. It still depends on the CPU: torch's CPU kernels pick their vector width by it
(torch.backends.cpu.get_cpu_capability(), which recipe.json records from now on; the committed
pair's is not known), and another width sums in another order, so the default remakes the
committed pair tensor for tensor only on the Python and torch that recipe.json names and the
machine that made it; elsewhere it makes a different pair, as good. More threads train faster and
make a different pair too.

The data is every machine's own: bytes (vocabulary 256, the `tiny` preset's) of the Python
standard library's source files, TRAIN_FILES for training and HELDOUT_FILES for held-out prompts
and text. Their content differs between Python versions, so a pair trained elsewhere differs
from the committed one; recipe.json beside it records the Python and torch that made it and a
hash of the training bytes.

1. target: the `tiny` preset (8 layers, 16 routed experts), next-byte cross-entropy through
   model.Transformer's own forward (the grouped experts swap, kernels.accelerate), saved with
   checkpoint.save_target;
2. draft vocabulary: the draft_vocab_size bytes the trained target predicts most often on the
   training text (draft.draft_vocab);
3. head: EAGLE-3's training-time test (draft.train_step: num_steps unrolled steps, each scored
   against the frozen target's own distribution), saved with checkpoint.save_draft;
4. measure: greedy speculative decoding from the held-out prompts (accepted tokens per cycle,
   bonus included) and the head's top-1 agreement with the target on held-out text.
"""
import argparse
import errno
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import sys
import sysconfig
import tempfile
import textwrap
import time
from contextlib import contextmanager

# Ctrl-C while torch loads (seconds): one line and exit status 130, as later (main). As a command,
# a Ctrl-C is only noted during the imports and acted on after them: raised inside torch's or
# Triton's C++, a KeyboardInterrupt can abort the process ("terminate called after throwing an
# instance of 'pybind11::error_already_set'") instead of unwinding to this line.
_ctrl_c = []


def _note_ctrl_c(signum, frame):
    """SIGINT's handler while a Ctrl-C is only noted (the imports, main's work)."""
    _ctrl_c.append(True)


_sigint = signal.signal(signal.SIGINT, _note_ctrl_c) if __name__ == "__main__" else None
try:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    import checkpoint
    import kernels
    import model
    from draft import Eagle3Draft, draft_preset, draft_vocab, train_step, ttt_loss
    from verify import generate
finally:
    if _sigint is not None:
        signal.signal(signal.SIGINT, _sigint)
if _ctrl_c:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # another Ctrl-C: the exit goes on
    print("train.py: interrupted; nothing started", file=sys.stderr)
    sys.exit(130)

HERE = os.path.dirname(os.path.abspath(__file__))
PAIR_DIR = os.path.join(HERE, "checkpoints", "tiny-stdlib")  # the committed pair, what run.py runs
TARGET_DIR, DRAFT_DIR = os.path.join(PAIR_DIR, "target"), os.path.join(PAIR_DIR, "eagle3")
OUT_DIR = os.path.join(HERE, "out", "tiny-stdlib")  # where training writes by default (not in git)
PAIR_PARTS = ("target", "eagle3", "recipe.json")   # what a pair's folder holds

# modules present in every CPython from 3.10 on (none of them removed or turned into a package
# since)
TRAIN_FILES = sorted([
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "configparser.py",
    "contextlib.py",
    "copy.py", "csv.py", "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py",
    "gettext.py", "heapq.py", "inspect.py", "ipaddress.py", "locale.py", "logging/__init__.py",
    "mailbox.py",
    "optparse.py", "os.py", "pickle.py", "platform.py", "pprint.py", "random.py", "shutil.py",
    "socket.py",
    "statistics.py", "subprocess.py", "tarfile.py", "tempfile.py", "threading.py", "tokenize.py",
    "traceback.py", "typing.py", "unittest/case.py", "urllib/parse.py", "uuid.py", "warnings.py",
    "weakref.py"])
HELDOUT_FILES = sorted([
    "bdb.py", "cmd.py", "code.py", "fileinput.py", "fnmatch.py", "glob.py", "gzip.py", "hmac.py",
    "queue.py",
    "sched.py", "shlex.py", "string.py", "textwrap.py", "timeit.py"])

SEQ_LEN = 128            # training windows (bytes); positions 0..127
TARGET = dict(steps=700, batch=16, lr=1e-2, warmup=30, seed=0)
DRAFT = dict(steps=350, batch=16, lr=1e-2, warmup=20, seed=1, num_steps=3)
VOCAB_BATCHES = 16  # batches of training text whose target predictions pick the draft vocabulary
EVAL = dict(prompt_len=64, max_new_tokens=64, num_steps=3, text_windows=64)
QUICK = dict(target_steps=20, draft_steps=10, prompts=2, text_windows=16)  # --quick: a short try
INTERRUPTED = 130        # the exit status of a run stopped by Ctrl-C, as shells give it (128 + 2)


def say(text):
    """Print text in lines of at most 120 columns (continuations indented), at once."""
    print(textwrap.fill(text, 120, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False), flush=True)


def read_files(names):
    """The bytes of the stdlib files `names` that exist here (a note names the missing ones)."""
    root = sysconfig.get_paths()["stdlib"]
    found = [n for n in names if os.path.isfile(os.path.join(root, n))]
    if len(found) < len(names):
        missing = ", ".join(sorted(set(names) - set(found)))
        say(f"note: not in this Python's stdlib ({root}): {missing}")
    if not found:
        raise FileNotFoundError(f"none of {names} in {root}")
    return {n: open(os.path.join(root, n), "rb").read() for n in found}


def corpus(names):
    """uint8 tensor: the files' bytes, one after another."""
    return torch.frombuffer(bytearray(b"".join(read_files(names).values())), dtype=torch.uint8)


def windows(data, batch, length, gen):
    """[batch, length] int64 windows of `data` at random offsets."""
    start = torch.randint(0, len(data) - length, (batch,), generator=gen)
    return data[start.unsqueeze(1) + torch.arange(length)].long()


def heldout_prompts(n, length):
    """n prompts of `length` bytes from the held-out files, each starting at a line of code (its
    first non-blank byte a letter): the first such line from the middle of file i mod their count,
    the k-th prompt of a file k such lines later (past the file's last one, from its middle again);
    a prompt longer than the rest of its file goes on through the held-out files."""
    files = list(read_files(HELDOUT_FILES).values())
    starts = [code_lines(text, text.rfind(b"\n", 0, len(text) // 2) + 1) for text in files]
    prompts = []
    for i in range(n):
        text, lines = files[i % len(files)], starts[i % len(files)]
        at = lines[(i // len(files)) % len(lines)]
        stream = text[at:at + length]
        # longer than the rest of the file: go on through all held-out files
        while len(stream) < length:
            stream += b"".join(files)[:length - len(stream)]
        prompts.append(list(stream))
    return prompts


def code_lines(text, at):
    """The offsets of the lines of code (not blank, a comment or a docstring line: the first
    non-blank byte a letter) in `text` from offset `at` on."""
    out = []
    while at < len(text):
        if text[at:at + 200].lstrip(b" ")[:1].isalpha():
            out.append(at)
        nl = text.find(b"\n", at)
        at = len(text) if nl < 0 else nl + 1
    return out


def lr_at(step, cfg):
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    frac = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def trainable(module):
    """The module's floating-point parameters, set to require grad (the project builds them
    frozen)."""
    params = [p for p in module.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    return params


def detach_caches(target):
    """forward writes the KV caches in place; under autograd they would carry one step's graph into
    the next. Cut it: each layer's caches detached in place. At first they are views of the
    Transformer's stacked caches, and autograd refuses a write into one view of a base after a
    write into another view taken before it (the second layer's): so the first call gives each
    layer caches of its own. Training moves no cache slots, which is what the stacked caches (then
    unused) are for."""
    for layer in target.layers:
        attn = layer.self_attn
        for name in ("kv_cache", "pe_cache"):
            cache = getattr(attn, name)
            if cache._base is not None:
                setattr(attn, name, cache.detach().clone())
            else:
                cache.detach_()


def fit(params, cfg, loss_fn, desc, before_step=lambda: None):
    """AdamW over cfg["steps"] steps of loss_fn(opt, gen) -> (loss, extra), before_step() ahead
    of each; returns every step's loss."""
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg["seed"])
    bar, history = tqdm(range(cfg["steps"]), desc=desc), []
    for step in bar:
        check_ctrl_c()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        before_step()
        loss, extra = loss_fn(opt, gen)
        history.append(loss)
        bar.set_postfix_str(f"loss {sum(history[-20:]) / len(history[-20:]):.3f} {extra}")
    return history


def train_target(data, cfg=TARGET):
    args = checkpoint.preset("tiny")
    target = model.Transformer(args, cfg["batch"], SEQ_LEN, dtype=torch.float32)
    checkpoint.init_random(target, cfg["seed"])
    # torch._grouped_mm: the experts' fast path on the CPU
    kernels.accelerate(target, moe="grouped")
    # the router's bias is for balancing (not trained by gradients): start it at 0
    for layer in target.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.zero_()
    positions = torch.arange(SEQ_LEN).expand(cfg["batch"], SEQ_LEN)

    def step(opt, gen):
        x = windows(data, cfg["batch"], SEQ_LEN + 1, gen)
        logits = target(x[:, :-1], positions).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item(), ""
    history = fit(trainable(target), cfg, step, "target", lambda: detach_caches(target))
    for p in target.parameters():
        p.requires_grad_(False)
    detach_caches(target)
    return target, history


def target_pass(target, tokens):
    """The frozen target over windows: its aux states and logits."""
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
        logits, states = target(tokens, positions, capture_aux=True)
    return states, logits


def train_draft(target, data, cfg=DRAFT):
    gen = torch.Generator().manual_seed(cfg["seed"] + 100)
    predicted = [target_pass(target, windows(data, cfg["batch"], SEQ_LEN, gen))[1].argmax(-1)
                 for _ in range(VOCAB_BATCHES)]
    head = Eagle3Draft(draft_preset("tiny"), target, max_seq_len=SEQ_LEN + cfg["num_steps"])
    head = checkpoint.init_random_draft(head, cfg["seed"])
    head.d2t.copy_(draft_vocab(torch.cat(predicted), head.args.vocab_size,
                               head.args.draft_vocab_size))

    def step(opt, gen):
        tokens = windows(data, cfg["batch"], SEQ_LEN, gen)
        states, logits = target_pass(target, tokens)
        loss, agree = train_step(head, opt, tokens, states, logits, cfg["num_steps"])
        return loss, "agree " + " ".join(f"{a:.2f}" for a in agree)
    history = fit(trainable(head), cfg, step, "eagle3 head")
    for p in head.parameters():
        p.requires_grad_(False)
    return head, history


def load_pair(max_batch_size=1, max_seq_len=256, dtype=torch.float32, device=None, folder=PAIR_DIR):
    """The pair saved in `folder` (target/ and eagle3/; default the committed one), loaded as run.py
    loads checkpoints."""
    target = checkpoint.load_target(os.path.join(folder, "target"), max_batch_size, max_seq_len,
                                    device, dtype)
    return target, checkpoint.load_draft(os.path.join(folder, "eagle3"), target)


def measure(target, head, n_prompts=12, text_windows=EVAL["text_windows"]):
    """Held-out numbers: mean accepted tokens per cycle (bonus included) of greedy speculative
    decoding, equality with plain greedy, and the head's top-1 agreement per step on held-out
    text."""
    prompts = heldout_prompts(n_prompts, EVAL["prompt_len"])
    check_ctrl_c()
    plain = generate(target, None, prompts, max_new_tokens=EVAL["max_new_tokens"], eos_id=-1)
    check_ctrl_c()
    spec = generate(target, head, prompts, max_new_tokens=EVAL["max_new_tokens"],
                    num_steps=EVAL["num_steps"],
                    eos_id=-1)
    live = spec.accepted[spec.accepted >= 0]
    text = corpus(HELDOUT_FILES)
    gen = torch.Generator().manual_seed(7)
    agree, bits = [], []
    for _ in range(text_windows // 16):
        check_ctrl_c()
        tokens = windows(text, 16, SEQ_LEN, gen)
        states, logits = target_pass(target, tokens)
        with torch.no_grad():
            agree.append(ttt_loss(head, tokens, states, logits, EVAL["num_steps"])[1])
        bits.append(F.cross_entropy(logits[:, :-1].flatten(0, 1),
                                    tokens[:, 1:].flatten()).item() / math.log(2))
    outside = cycles_outside_runs(spec.tokens, prompts, spec.accepted)
    return dict(accept_len_mean=live.float().mean().item() + 1,
                accept_len_hist=torch.bincount(live + 1,
                                               minlength=EVAL["num_steps"] + 2)[1:].tolist(),
                accept_len_mean_outside_runs=sum(outside) / max(1, len(outside)),
                cycles_outside_runs=len(outside),
                speculative_equals_plain=spec.tokens == plain.tokens,
                top1_agreement_per_step=[sum(a[i] for a in agree) / len(agree)
                                         for i in range(EVAL["num_steps"])],
                target_bits_per_byte=sum(bits) / len(bits),
                sample=bytes(prompts[0] + plain.tokens[0]).decode("utf-8", "replace"))


def cycles_outside_runs(outputs, prompts, accepted):
    """The tokens each cycle emitted (accepted + 1), for the cycles that do more than go on with a
    run of one byte: the tiny target's greedy output falls into runs of spaces, where the head
    guesses every token, so the mean over all cycles says more of the runs than of the head.
    accepted [C, B] as verify.generate returns it (-1 once a row finished)."""
    kept = []
    for row, (out, prompt) in enumerate(zip(outputs, prompts)):
        seq, at = list(prompt) + list(out), len(prompt) + 1     # the prefill emitted out[0]
        for a in accepted[:, row].tolist():
            if a < 0:
                break
            if len(set(seq[at - 1:at + a + 1])) > 1:         # not one byte on from the last
                kept.append(a + 1)
            at += a + 1
    return kept


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as run.py's refusals (no usage block)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    p = Parser(prog="train.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the folder to write the pair to (target/, eagle3/, "
                   "recipe.json); default out/tiny-stdlib, not the committed "
                   "checkpoints/tiny-stdlib; with --eval, the pair to measure")
    p.add_argument("--overwrite-committed", action="store_true",
                   help="allow writing into the committed "
                   "pair's folder checkpoints/tiny-stdlib (--out, or --eval's recipe.json)")
    p.add_argument("--eval", nargs="?", const="", metavar="DIR",
                   help="only measure the pair in DIR (default: --out's folder if given, else the "
                   "committed one) and print the numbers; with --overwrite-committed, also write "
                   "them into the committed pair's recipe.json")
    p.add_argument("--quick", action="store_true", help=f"a quick try of every step: "
                   f"{QUICK['target_steps']} target and {QUICK['draft_steps']} head training steps "
                   f"instead of {TARGET['steps']} and {DRAFT['steps']}, measured on "
                   f"{QUICK['prompts']} prompts; the pair is poor, its numbers no guide")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: the committed "
                   "pair is reproduced only with 1; more train faster and make a different pair)")
    args = p.parse_args(argv)
    check_threads(p, args.threads)
    out_given, args.out = args.out is not None, args.out or OUT_DIR
    if args.eval is not None:
        check_eval(p, args, out_given)
    folder = args.out if args.eval is None else args.eval
    if args.overwrite_committed and os.path.realpath(folder) != os.path.realpath(PAIR_DIR):
        p.error(f"--overwrite-committed: {folder} is not the committed pair; the flag applies "
                "only where --out or --eval names checkpoints/tiny-stdlib")
    if args.eval is None:
        check_out(p, args)
    return args


def check_threads(p, threads):
    """--threads from 1 to the machine's CPUs (os.cpu_count()): more threads than CPUs take turns
    on them, and a run meant for minutes takes far longer. Refused in one line (p's)."""
    cpus = os.cpu_count() or 1
    if threads < 1:
        p.error(f"--threads {threads}: must be at least 1")
    if threads > cpus:
        p.error(f"--threads {threads}: this machine has {cpus} CPUs; give at most {cpus}")


def check_eval(p, args, out_given):
    """--eval's folder: DIR, else --out's if given, else the committed pair; it must hold a pair."""
    if args.quick:
        p.error("--quick shortens training; --eval trains nothing (give one of them)")
    if args.eval and out_given and os.path.realpath(args.eval) != os.path.realpath(args.out):
        p.error(f"--out {args.out} --eval {args.eval}: two folders; measure one "
                "(--eval DIR, or --out DIR --eval)")
    args.eval = args.eval or (args.out if out_given else PAIR_DIR)
    for part in ("target", "eagle3"):
        if not os.path.isdir(os.path.join(args.eval, part)):
            p.error(f"--eval {args.eval}: no pair there (no {part}/ folder; train.py writes one "
                    "with --out)")


def check_out(p, args):
    """--out before minutes of training, not after: not the committed pair (unless allowed, and
    then not for --quick), and writable. args.created: the outermost folder this run creates
    (None: none)."""
    if os.path.realpath(args.out) == os.path.realpath(PAIR_DIR):
        if not args.overwrite_committed:
            p.error(f"--out {args.out} is the committed pair; --overwrite-committed remakes it")
        if args.quick:
            p.error("--quick would replace the committed pair with a poor one; give another --out")
    args.work = None   # the work folder train makes inside args.out
    try:
        args.created = make_folder(args.out)
    except OSError as e:
        p.error(f"--out {args.out}: cannot write there ({e.strerror or e})")


def make_folder(path):
    """Make the folder `path` (and the missing folders above it) and write a file in it: before
    minutes of work, not after. Returns the outermost folder made (None: it was there), for
    remove_made after a Ctrl-C; where it cannot be written, OSError, and nothing is left made."""
    made, up = None, os.path.abspath(path)
    while not os.path.exists(up):
        made, up = up, os.path.dirname(up)
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder")
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return made


def remove_made(made):
    """Remove the folder make_folder made (nothing finished in it); returns its name, relative
    where it is below the working folder, as a user would have named it."""
    shutil.rmtree(made, ignore_errors=True)
    shown = os.path.relpath(made)
    return made if shown.startswith(os.pardir) else shown


def main(argv=None):
    """Train (or with --eval, measure); Ctrl-C ends it in one line with exit status 130. As during
    the imports, a Ctrl-C is noted when pressed and acted on at the next step (check_ctrl_c): a
    KeyboardInterrupt raised inside torch's C++ can leave its state half made (a training step
    then failing with "Can't detach views in-place") or abort the process. A pair that does not
    load (--eval's) is one line too, exit status 2."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        with ctrl_c_noted():
            if args.eval is not None:
                evaluate(args)
            else:
                train(args)
    except KeyboardInterrupt:
        print(f"train.py: interrupted{tidy(args)}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except checkpoint.CheckpointError as e:   # a pair that does not load (--eval's), as run.py
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:   # any other error too leaves no work folder (a SIGTERM's default end does)
        if getattr(args, "work", None) is not None:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


@contextmanager
def ctrl_c_noted():
    """Inside the block a Ctrl-C is only noted, and raised (KeyboardInterrupt) by the next
    check_ctrl_c, between steps; once it is raised, further Ctrl-Cs are ignored, so that the
    tidying and the exit go on. The previous handler is back after a block that ends otherwise."""
    _ctrl_c.clear()
    previous = signal.signal(signal.SIGINT, _note_ctrl_c)
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
    finally:
        if not interrupted:
            signal.signal(signal.SIGINT, previous)


def check_ctrl_c():
    """Stop here (KeyboardInterrupt, main's) if Ctrl-C was pressed since the last check: called
    between steps, never inside one."""
    if _ctrl_c:
        raise KeyboardInterrupt


def tidy(args):
    """After Ctrl-C: the work folder goes (nothing reached --out), and the --out folder too where
    this run created it; say so."""
    if args.eval is not None:
        return ""
    if args.work is not None:
        shutil.rmtree(args.work, ignore_errors=True)
    if args.created is not None:
        return f"; nothing finished, {remove_made(args.created)} removed"
    return f"; nothing finished, nothing written into {args.out}"


def install(work, out):
    """Move the pair made in `work` (target/, eagle3/, recipe.json) into `out`, each part by one
    rename (a pair there before moves out of the way first), then remove `work`: a run killed
    before (SIGTERM, SIGKILL) leaves `out` as it was. The three renames are not one step: a run
    killed between two of them leaves parts of two pairs (recipe.json, moved last, the old
    one's)."""
    for part in PAIR_PARTS:
        there = os.path.join(out, part)
        if os.path.lexists(there):
            os.rename(there, os.path.join(work, part + ".old"))
        os.rename(os.path.join(work, part), there)
    shutil.rmtree(work)


def evaluate(args):
    """Measure the pair in args.eval again; into recipe.json beside the training record if
    allowed."""
    target, head = load_pair(max_batch_size=16, folder=args.eval)
    numbers = measure(target, head)
    if os.path.realpath(args.eval) != os.path.realpath(PAIR_DIR) or args.overwrite_committed:
        path = os.path.join(args.eval, "recipe.json")
        recipe = json.load(open(path)) if os.path.exists(path) else {}
        write_recipe(dict(recipe, **numbers), args.eval)
    else:
        show(numbers)


def train(args):
    """Train the target, then the head, each saved as soon as it is trained, measure the pair and
    write recipe.json, all in a work folder inside --out (args.work: .train-*, on its file
    system); then move the pair into --out (install)."""
    out, target_cfg, draft_cfg, eval_kw = args.out, TARGET, DRAFT, {}
    if args.quick:
        target_cfg = dict(TARGET, steps=QUICK["target_steps"])
        draft_cfg = dict(DRAFT, steps=QUICK["draft_steps"])
        eval_kw = dict(n_prompts=QUICK["prompts"], text_windows=QUICK["text_windows"])
        say(f"quick try: {target_cfg['steps']} target and {draft_cfg['steps']} head training steps "
            f"(the real pair: {TARGET['steps']} and {DRAFT['steps']}), measured on "
            f"{QUICK['prompts']} prompts; a poor pair")
    args.work = tempfile.mkdtemp(prefix=".train-", dir=out)
    target_dir, draft_dir = os.path.join(args.work, "target"), os.path.join(args.work, "eagle3")
    data = corpus(TRAIN_FILES)
    say(f"training bytes: {len(data):,} from {len(TRAIN_FILES)} stdlib files of Python "
        f"{platform.python_version()}, {args.threads} thread(s), into {out}")
    t0, c0 = time.perf_counter(), time.process_time()
    target, t_hist = train_target(data, target_cfg)
    checkpoint.save_target(target, target_dir)
    t1, c1 = time.perf_counter(), time.process_time()
    target = checkpoint.load_target(target_dir, draft_cfg["batch"], SEQ_LEN, dtype=torch.float32)
    kernels.accelerate(target, moe="grouped")
    head, d_hist = train_draft(target, data, draft_cfg)
    checkpoint.save_draft(head, draft_dir)
    t2, c2 = time.perf_counter(), time.process_time()
    target, head = load_pair(max_batch_size=16, folder=args.work)
    numbers = measure(target, head, **eval_kw)
    recipe = dict(python=platform.python_version(), torch=torch.__version__,
                  machine=platform.machine(),
                  cpu_capability=torch.backends.cpu.get_cpu_capability(),
                  cpu_threads=torch.get_num_threads(),
                  date=time.strftime("%Y-%m-%d", time.gmtime()), train_files=TRAIN_FILES,
                  heldout_files=HELDOUT_FILES, train_bytes=len(data),
                  train_sha256=hashlib.sha256(data.numpy().tobytes()).hexdigest(), seq_len=SEQ_LEN,
                  target=target_cfg, draft=draft_cfg, eval=EVAL, target_train_s=t1 - t0,
                  draft_train_s=t2 - t1, target_train_cpu_s=c1 - c0, draft_train_cpu_s=c2 - c1,
                  load_average=os.getloadavg(), target_final_loss=mean_last(t_hist),
                  draft_final_loss=mean_last(d_hist), **numbers)
    if args.quick:
        recipe.update(quick=eval_kw)
    write_recipe(recipe, args.work)
    check_ctrl_c()   # the last point a Ctrl-C stops the run: the pair moves into --out whole
    install(args.work, out)
    say(f"time it: python run.py --model-path {os.path.join(out, 'target')} --draft-path "
        f"{os.path.join(out, 'eagle3')} (on random prompt ids; python train.py --eval {out} "
        "measures it on held-out source)")


def mean_last(history, n=20):
    """The mean of the last n losses (of all, if fewer)."""
    return sum(history[-n:]) / len(history[-n:])


def write_recipe(recipe, folder):
    with open(os.path.join(folder, "recipe.json"), "w") as f:
        json.dump(recipe, f, indent=1)
    show({k: v for k, v in recipe.items() if not k.endswith("_files")})


def show(numbers):
    """The numbers as JSON, one value a line; the sample text (a held-out prompt and the target's
    greedy continuation) after them as its JSON string, in lines of at most 100 characters."""
    print(json.dumps({k: v for k, v in numbers.items() if k != "sample"}, indent=1))
    if "sample" in numbers:
        text = json.dumps(numbers["sample"])
        print("sample:\n" + "\n".join("  " + text[i:i + 100] for i in range(0, len(text), 100)))


if __name__ == "__main__":
    sys.exit(main())
