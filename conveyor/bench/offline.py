"""`conveyor bench offline`: offline throughput of conveyor's Python API against transformers'
`generate` on the same workload, in one run (the seeds' "HF" baseline).

    conveyor bench offline --model /path/to/checkpoint --dataset sharegpt --dataset-path sg.json \\
        --num-prompts 200 --hf-batch-size 16

What keeps the comparison fair: both engines get bench serve's workload (dataset.py, its lengths
counted by the checkpoint's tokenizer.json) as text, greedy, each request held to exactly its
wanted output length (`run_conveyor`, `run_transformers`); each does one short warm-up generation,
then is timed over the whole workload; conveyor is released before transformers loads, so they
never share the device's memory. Throughput counts the wanted output tokens: what transformers
computes for padding and for the shorter members of a batch is its waste, shown apart as
generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

from conveyor.bench.args import OFFLINE_ENGINE_OPTIONS
from conveyor.bench.dataset import BenchRequest, DatasetConfig, make_dataset
from conveyor.bench.prompts import FileCounter
from conveyor.sim.report import markdown_table


@dataclasses.dataclass(frozen=True)
class OfflineResult:
    engine: str
    num_requests: int
    seconds: float
    num_prompt_tokens: int
    num_output_tokens: int  # the wanted output tokens, produced
    num_generated_tokens: int  # what the engine computed to produce them (padding included)

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_throughput(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.seconds

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_throughput": self.total_throughput,
        }


def run_conveyor(requests: list[BenchRequest], model: str, **engine_options) -> tuple[OfflineResult, str, str]:
    """Time LLM(model).generate(prompts, one SamplingParams(max_tokens=n, ignore_eos) each), continuous
    batching over the whole workload; also returns the device and dtype it resolved."""
    from conveyor import LLM, SamplingParams

    llm = LLM(model=model, **engine_options)
    device, dtype = llm.config.parallel.device, llm.config.model.dtype
    llm.generate(["warm up the engine"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    _synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params)
    _synchronize(device)
    seconds = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = OfflineResult("conveyor", len(requests), seconds, sum(len(o.prompt_token_ids) for o in outputs), num_output, num_output)
    del llm, outputs
    _release(device)
    return result, device, dtype


def run_transformers(requests: list[BenchRequest], model: str, *, device: str, dtype: str, batch_size: int) -> OfflineResult:
    """Time transformers' generate over the workload: static batches of `batch_size` prompts in
    workload order, padded on the left; each batch generates the longest wanted output of its
    members (max_new_tokens = min_new_tokens, so EOS never stops it early)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # transformers types `.to` on a loaded model as taking the model again (its wrapper's signature)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()  # type: ignore[arg-type]

    def generate(prompts: list[str], num_tokens: int) -> tuple[int, int]:
        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = hf.generate(
                **batch, do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=tokenizer.pad_token_id
            )
        num_prompt = int(batch["attention_mask"].sum())
        return num_prompt, out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])

    generate(["warm up the engine"], 4)
    num_prompt = num_generated = 0
    _synchronize(device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        p, g = generate([r.prompt for r in batch], max(r.output_len for r in batch))
        num_prompt, num_generated = num_prompt + p, num_generated + g
    _synchronize(device)
    seconds = time.perf_counter() - start
    wanted = sum(r.output_len for r in requests)
    return OfflineResult(f"transformers (batch {batch_size})", len(requests), seconds, num_prompt, wanted, num_generated)


def _cpu_line(device: str) -> str:
    """On a CPU, the CPU's model and the C++ kernels' ISA variant (CONVEYOR_CPU_ISA); else ""."""
    if device != "cpu":
        return ""
    from conveyor.gpu.backends.cpu.kernels import isa

    return f"CPU {isa.describe_in_use()}"


def _synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except ValueError as e:  # an unknown dataset, a missing --dataset-path, a prompt too long
        print(f"conveyor bench offline: error: {e}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    from conveyor.tiny.checkpoint import ensure_default_model

    model = str(args.model or ensure_default_model())
    config = DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        path=args.dataset_path,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
    )
    requests = asyncio.run(make_dataset(config, FileCounter(Path(model) / "tokenizer.json")))
    if not requests:
        raise ValueError("the dataset is empty")
    options = {name: getattr(args, name) for name in OFFLINE_ENGINE_OPTIONS}
    ours, device, dtype = run_conveyor(requests, model, **options)
    results = [ours]
    if not args.skip_hf:
        results.append(run_transformers(requests, model, device=device, dtype=dtype, batch_size=args.hf_batch_size))

    prompt = sum(r.prompt_len for r in requests) / len(requests)
    output = sum(r.output_len for r in requests) / len(requests)
    cpu = _cpu_line(device)
    where = f"model {model} on {device} ({dtype})" + (f"\n{cpu}" if cpu else "")
    print(f"{where}\ndataset {config.name}: {len(requests)} requests, mean prompt {prompt:.0f} / output {output:.0f} tokens\n")
    header = ["engine", "seconds", "requests/s", "output tokens/s", "total tokens/s", "generated tokens"]
    body = [
        [
            r.engine,
            f"{r.seconds:.2f}",
            f"{r.request_throughput:.2f}",
            f"{r.output_throughput:.1f}",
            f"{r.total_throughput:.1f}",
            str(r.num_generated_tokens),
        ]
        for r in results
    ]
    print(markdown_table(header, body))
    ratio = results[0].output_throughput / results[1].output_throughput if len(results) > 1 else None
    if ratio is not None:
        print(f"\nconveyor / transformers: {ratio:.2f}x output tokens/s")
    if args.result_json:
        report = {
            "model": model,
            "device": device,
            "dtype": dtype,
            "cpu": cpu or None,
            "dataset": dataclasses.asdict(config),
            "results": [r.as_dict() for r in results],
            "ratio": ratio,
        }
        with open(args.result_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
