"""Before/after evidence for a refactor that must not change behaviour: dump what a tree computes on
tiny checkpoints, then compare two dumps bit for bit.

    python ops/bench/step_snapshot.py checkpoints DIR          # once, with the current tree
    CONVEYOR_TREE=/tmp/base python ops/bench/step_snapshot.py dump --checkpoints DIR --out base.pt
    CONVEYOR_TREE=/work/main python ops/bench/step_snapshot.py dump --checkpoints DIR --out head.pt
    python ops/bench/step_snapshot.py compare base.pt head.pt  # exit 1 on any difference

CONVEYOR_TREE (else the first PYTHONPATH entry with a conveyor/, else this script's checkout) names
the tree whose `conveyor` is imported (first on sys.path; the dump checks `conveyor.__file__`). It
uses only what e0cd530 had too: `conveyor.LLM`, `generate` / `embed`, the runner's `model`, its
`backend.attn` and `compute_logits`; the runner is whichever LLM builds (gpu/runner.py at e0cd530,
gpu/step/runner.py since). Items:

- `logits/<family>/<dtype>`: all-position logits [T, V] of four fixed prompts in one prefill
  forward (fresh paged cache, block size 4), for every family the tests build (tests/
  gpu_checkpoints.py, tests/moe_checkpoints.py), float32 and bfloat16.
- `plain/<family>/<dtype>`: one generate call mixing greedy, seeded (temperature 0.8), seeded
  with n=2, top-p/top-k, repetition penalty and logprobs, and prompt logprobs.
- `<scenario>/<dtype>` on the small Llama of tests/conftest.py: speculation (ngram, a draft cut
  from the target, EAGLE-3), grammars (JSON schema, regex, choice; multi-step too), LoRA (two
  adapters and the base in one batch), pooling (last and mean), a pool small enough to preempt,
  fp8 KV, and `mixed*`: one batch of everything (two adapters and the base, every sampling kind,
  grammars, prompt logprobs), plain, with ngram speculation, and multi-step. Each runs its batch
  twice on one engine: the second round's prompts hit the prefix cache.

A generate item holds every choice's ids, text, finish and stop reason, logprobs, prompt logprobs,
embedding, cached tokens, and the step count; one that raises holds the error's text.
Torch threads are fixed (--threads, default 1): float32 sums split by the thread count, and on
two busy cores two threads took 4.5 minutes where one takes 15 seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Whose conveyor (and tests/) to import: CONVEYOR_TREE, else PYTHONPATH's first tree that has one.
_ON_PATH = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and (Path(d) / "conveyor").is_dir()]
TREE = Path(os.environ.get("CONVEYOR_TREE") or (_ON_PATH[0] if _ON_PATH else REPO)).resolve()
sys.path.insert(0, str(TREE))

import torch  # noqa: E402

DTYPES = ("float32", "bfloat16")
SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
READY = "READY"  # written last by `checkpoints`: a half-made DIR is refused


def make_checkpoints(root: Path) -> None:
    """Made once, by one tree, so that both dumps read the same files (seeded: the same every time)."""
    from conveyor.tiny.checkpoint import make_checkpoint
    from conveyor.tiny.eagle3 import make_eagle3_head
    from conveyor.tiny.embedding import make_embedding_checkpoint
    from conveyor.tiny.lora import make_random_adapter
    from conveyor.tiny.truncate import truncate
    from tests import gpu_checkpoints, moe_checkpoints

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    llama = make_checkpoint(root / "llama", "LlamaForCausalLM", seed=1, **SMALL)  # tests/conftest.py's
    families = [*gpu_checkpoints.ARCHS, "phi3_long"]
    for name in [*families, *moe_checkpoints.MOE_ARCHS]:
        module = moe_checkpoints if name in moe_checkpoints.MOE_ARCHS else gpu_checkpoints
        dst = root / "families" / name
        shutil.copytree(module.checkpoint(name), dst)
        for file in TOKENIZER_FILES:  # a 4096-id tokenizer over a 512-id vocabulary: prompts are ids
            shutil.copy(llama / file, dst / file)
    truncate(llama, root / "draft", 1)
    make_eagle3_head(llama, root / "eagle3", seed=1, draft_vocab_size=1024, aux_layers=(1, 0, 1))
    make_random_adapter(llama, root / "lora-a", rank=8, seed=1)
    make_random_adapter(llama, root / "lora-b", rank=16, targets=("q_proj", "v_proj", "down_proj"), seed=2)
    for pooling in ("last", "mean"):
        make_embedding_checkpoint(llama, root / f"embed-{pooling}", pooling=pooling)
    (root / READY).write_text(f"made by {TREE}\n")


def _commit(tree: Path) -> str:
    """The tree's commit, with "+dirty" for uncommitted changes; "" outside a git checkout."""
    if not (tree / ".git").exists():
        return ""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _prompt_ids(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


LOGIT_PROMPTS = _prompt_ids((37, 50, 1, 20), 512)  # windows of 8, 16 and 32 are crossed; phi3_long's 32 too
FAMILY_PROMPTS = [*_prompt_ids((9, 23), 512, seed=1), [5, 6, 7, 8] * 5, _prompt_ids((9,), 512, seed=1)[0] + [3, 4]]
TEXT_PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm sun all day long",
    "a b c d e f g h a b c d e f g h a b c d",
    "Hello, my name is Ann and",
]
SCHEMA = (
    '{"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},'
    ' "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["id"]}'
)


def _params() -> dict:
    from conveyor import SamplingParams
    from conveyor.wire.messages import StructuredOutput

    def p(**kw) -> SamplingParams:
        kw.setdefault("max_tokens", 24)
        kw.setdefault("ignore_eos", True)
        return SamplingParams(**kw)

    def grammar(kind: str, spec: str, **kw) -> SamplingParams:
        return p(structured=StructuredOutput(kind, spec), ignore_eos=False, max_tokens=40, **kw)  # type: ignore[arg-type]

    return {
        "greedy": p(temperature=0.0),
        "seeded": p(temperature=0.8, seed=7),
        "rich": p(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.3, seed=11, n=2, logprobs=3),
        "prompt_lp": p(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=2),
        "penalised": p(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4, stop=[" the"]),
        "json": grammar("json_schema", SCHEMA, temperature=0.0),
        "json_seeded": grammar("json_schema", SCHEMA, temperature=1.0, seed=5, n=2),
        "regex": grammar("regex", r"[a-z]{2,5}-[0-9]{2}", temperature=0.8, seed=3),
        "choice": grammar("choice", '["yes", "no", "maybe so"]', temperature=0.0),
    }


def scenarios(ckpt: Path) -> dict[str, tuple[Path, dict, list, list[str], list[str | None] | None]]:
    """name -> (checkpoint, LLM options, prompts, parameter names per prompt, adapter per prompt)."""
    llama, four = ckpt / "llama", TEXT_PROMPTS
    plain = ["greedy", "seeded", "rich", "penalised"]
    grammars = ["json", "json_seeded", "regex", "choice"]

    def spec(method: str, **kw) -> dict:
        return {"speculative_config": {"method": method, "num_speculative_tokens": 3, **kw}}

    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    ngram = spec("ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    every = [*plain, *grammars, "prompt_lp", "rich", "greedy", "seeded"]  # one batch, all of it
    every_adapter = [None, "a", "b", None] * 3
    return {
        "spec-ngram": (llama, ngram, four, plain, None),
        "spec-draft": (llama, spec("draft_model", model=str(ckpt / "draft"), draft_length="fixed"), four, plain, None),
        "spec-eagle3": (llama, spec("eagle3", model=str(ckpt / "eagle3"), draft_length="fixed"), four, plain, None),
        "spec-ngram-grammar": (llama, ngram, four, grammars, None),
        "grammar": (llama, {}, four, grammars, None),
        "grammar-multistep": (llama, {"num_scheduler_steps": 4}, four, grammars, None),
        "multistep": (llama, {"num_scheduler_steps": 4}, four, plain, None),
        "lora": (llama, lora, four * 2, plain * 2, ["a", "b", None, "a", "b", None, "b", "a"]),
        "prompt-logprobs": (llama, {}, four, ["prompt_lp"] * 4, None),
        "preempt": (llama, {"num_kv_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16}, four * 2, plain * 2, None),
        "kv-fp8": (llama, {"kv_cache_dtype": "fp8"}, four, plain, None),
        "mixed": (llama, lora, four * 3, every, every_adapter),
        "mixed-spec": (llama, {**lora, **ngram}, four * 3, every, every_adapter),
        "mixed-multistep": (llama, {**lora, "num_scheduler_steps": 4}, four * 3, every, every_adapter),
        "embed-last": (ckpt / "embed-last", {}, four, [], None),
        "embed-mean": (ckpt / "embed-mean", {}, four, [], None),
    }


def _llm(path: Path, dtype: str, **options):
    from conveyor import LLM

    options.setdefault("num_kv_blocks", 256)
    return LLM(str(path), device="cpu", dtype=dtype, **options)


def prefill_logits(llm) -> torch.Tensor:
    """All-position logits [T, V] of LOGIT_PROMPTS, flattened in one forward with a fresh cache
    (tests/gpu/test_gpu_model.py's forward_prompts, which e0cd530 had too)."""
    model, block_size = llm.runner.model, 4
    attn = model.backend.attn
    lens = [len(p) for p in LOGIT_PROMPTS]
    num_blocks = [-(-n // block_size) for n in lens]
    caches = attn.allocate_kv_caches(sum(num_blocks), block_size)
    ids = list(range(sum(num_blocks)))[::-1]
    tables = torch.zeros(len(lens), max(num_blocks), dtype=torch.int32)
    for i, n in enumerate(num_blocks):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = attn.build_metadata(lens, lens, tables, positions, block_size, llm.config.model.sliding_window)
    input_ids = torch.tensor([t for p in LOGIT_PROMPTS for t in p])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, meta, caches)).clone()


def _record(llm, outputs, names: list[str], adapters: list[str | None] | None) -> dict:
    """Each request's outputs, keyed "INDEX:PARAMS[@ADAPTER]" so a difference names its request."""
    import msgspec

    def lp(items: list | None) -> list | None:
        return None if items is None else [None if x is None else msgspec.to_builtins(x) for x in items]

    requests = {}
    for i, o in enumerate(outputs):
        choices = [
            {
                "ids": c.token_ids,
                "text": c.text,
                "finish": c.finish_reason,
                "stop": c.stop_reason,
                "cum_lp": c.cumulative_logprob,
                "lp": lp(c.logprobs),
            }
            for c in o.outputs
        ]
        key = f"{i}:{names[i]}" + (f"@{adapters[i]}" if adapters and adapters[i] else "")
        requests[key] = {
            "choices": choices,
            "prompt_lp": lp(o.prompt_logprobs),
            "embedding": o.embedding,
            "cached": o.num_cached_tokens,
        }
    return {"requests": requests, "num_steps": llm.core.scheduler.num_steps}


def _generate(llm, prompts, names, adapters, ckpt: Path):
    from conveyor import LoRARequest

    table = _params()
    loras = None if adapters is None else [None if a is None else LoRARequest(a, str(ckpt / f"lora-{a}")) for a in adapters]
    return llm.generate(prompts, [table[n] for n in names], lora_request=loras)


def dump(ckpt: Path, only: str | None) -> dict:
    if not (ckpt / READY).exists():
        raise SystemExit(f"{ckpt} has no {READY}: make it first with `step_snapshot.py checkpoints {ckpt}`")
    items: dict = {}

    def run(name: str, fn) -> None:
        if only is not None and only not in name:
            return
        start = time.perf_counter()
        try:
            items[name] = fn()
        except Exception as e:  # recorded: the other tree must raise the same
            items[name] = f"raised {type(e).__name__}: {e}"
        print(f"{time.perf_counter() - start:6.2f}s {name}" + (" RAISED" if isinstance(items[name], str) else ""), flush=True)

    families = sorted(p.name for p in (ckpt / "families").iterdir())
    for dtype in DTYPES:
        for family in families:
            engines: list = []  # the family's LLM, made by whichever of its two items runs first

            def engine(family: str = family, dtype: str = dtype, engines: list = engines):
                if not engines:
                    engines.append(_llm(ckpt / "families" / family, dtype))
                return engines[0]

            def family_plain(engine=engine) -> dict:
                names = ["greedy", "seeded", "rich", "prompt_lp"]
                return _record(engine(), _generate(engine(), FAMILY_PROMPTS, names, None, ckpt), names, None)

            run(f"logits/{family}/{dtype}", lambda engine=engine: prefill_logits(engine()))
            run(f"plain/{family}/{dtype}", family_plain)
        for name, (path, options, prompts, names, adapters) in scenarios(ckpt).items():

            def scenario(path=path, options=options, prompts=prompts, names=names, adapters=adapters, dtype=dtype) -> dict:
                llm = _llm(path, dtype, **options)
                rounds = {}
                for round in ("first", "again"):  # again: the same batch, its prompts in the prefix cache
                    outputs = llm.embed(prompts) if not names else _generate(llm, prompts, names, adapters, ckpt)
                    rounds[round] = _record(llm, outputs, names or ["embed"] * len(prompts), adapters)
                return rounds

            run(f"{name}/{dtype}", scenario)
    return items


def _same(a, b) -> bool:
    """Bit for bit: tensors by their bytes (so -0.0 is not 0.0, and NaN is NaN), floats likewise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bits(a), _bits(b))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _diffs(a, b, path: str = ""):
    """(path, what differs) for each differing leaf of two nested values, tensors as leaves."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            yield path, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        elif not _same(a, b):
            differ = _bits(a) != _bits(b)  # elementwise, bit for bit
            d = (a.double() - b.double()).abs()[differ].nan_to_num(nan=float("inf"))
            rows = int(differ.any(dim=-1).sum()) if differ.dim() > 1 else 1
            argmax = "" if a.dim() < 2 else f", argmax differs in {int((a.argmax(-1) != b.argmax(-1)).sum())} rows"
            yield path, f"{int(differ.sum())} of {a.numel()} elements in {rows} rows differ, max |d| {float(d.max()):.3g}{argmax}"
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys(), key=str):
            if k not in a or k not in b:
                yield f"{path}.{k}", "missing on one side"
            else:
                yield from _diffs(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and not _is_leaf_list(a) and not _is_leaf_list(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diffs(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            yield path, f"lengths {len(a)} vs {len(b)}"
    elif not _same(a, b):
        yield path, f"{str(a)[:80]} vs {str(b)[:80]}"


def _is_leaf_list(x: list) -> bool:
    """Token ids and vectors are shown whole; lists of records are walked."""
    return all(isinstance(v, (int, float)) for v in x)


def _describe(a, b) -> str:
    found = list(_diffs(a, b))
    fields = sorted({path.rsplit(".", 1)[-1].split("[")[0] for path, _ in found} - {""})
    requests = sorted({m for path, _ in found for m in re.findall(r"requests\.([^.]+)", path)}, key=lambda k: int(k.split(":")[0]))
    where = f"; requests {', '.join(requests)}" if requests else ""
    head = "; ".join(f"{path}: {what}" for path, what in found[:2])
    what = f" (fields: {', '.join(fields)}{where})" if fields else ""
    return f"{len(found)} leaves differ{what}; {head}"


def compare(path_a: Path, path_b: Path) -> int:
    a, b = torch.load(path_a, weights_only=True), torch.load(path_b, weights_only=True)
    print(f"A: {a['meta']}\nB: {b['meta']}")
    if a["meta"]["threads"] != b["meta"]["threads"] or a["meta"]["torch"] != b["meta"]["torch"]:
        print("WARNING: the dumps ran with different torch versions or thread counts")
    items_a, items_b = a["items"], b["items"]
    num_diff = 0
    for name in sorted(items_a.keys() | items_b.keys()):
        if name not in items_a or name not in items_b:
            print(f"DIFF {name}: only in {'A' if name in items_a else 'B'}")
        elif _same(items_a[name], items_b[name]):
            print(f"same {name}")
            continue
        else:
            print(f"DIFF {name}: {_describe(items_a[name], items_b[name])}")
        num_diff += 1
    print(f"{len(items_a.keys() | items_b.keys()) - num_diff} same, {num_diff} different")
    return 1 if num_diff else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("checkpoints", help="make the tiny checkpoints (once)").add_argument("dir", type=Path)
    d = sub.add_parser("dump", help="run every item with CONVEYOR_TREE's conveyor")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--checkpoints", type=Path, required=True)
    d.add_argument("--threads", type=int, default=1, help="torch threads: both dumps must use the same")
    d.add_argument("--only", help="only items whose name contains this")
    d.add_argument("--label", help="what the tree is, for the record (default: its git commit)")
    c = sub.add_parser("compare", help="bit-identical check of two dumps")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.mode == "compare":
        return compare(args.a, args.b)
    import conveyor

    where = Path(conveyor.__file__).resolve()
    print(f"conveyor from {where}", flush=True)
    if not where.is_relative_to(TREE):
        raise SystemExit(f"CONVEYOR_TREE={TREE} but conveyor came from {where}")
    if args.mode == "checkpoints":
        make_checkpoints(args.dir)
        return 0
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    items = dump(args.checkpoints.resolve(), args.only)
    meta = {"conveyor": str(where), "label": args.label or _commit(TREE), "torch": str(torch.__version__), "threads": args.threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": meta, "items": items}, args.out)
    print(f"{len(items)} items in {time.perf_counter() - start:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
