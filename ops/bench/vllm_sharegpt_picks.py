"""vLLM's own ShareGPT picks, written as tests/ops/vllm_sharegpt_picks.json: run by vLLM's python,
not conveyor's (it imports vLLM alone), so the fixture comes from vLLM's code, not from ours.

    ~/.cache/conveyor-peers/vllm-cpu/bin/python ops/bench/vllm_sharegpt_picks.py TOKENIZER_DIR \\
        /work/shared/workloads/sharegpt_sample.json 500 0 > tests/ops/vllm_sharegpt_picks.json

(the venv is ../shared/peers/vllm-cpu.sh's). It builds the tokenizer as `vllm bench serve
--tokenizer TOKENIZER_DIR` does and samples with vLLM's ShareGPTDataset, as `--dataset-name
sharegpt --seed SEED --num-prompts NUM` does. Written: each pick's prompt (a hash) and lengths in
request order, and every pair's (turn 0, turn 1) token counts by that tokenizer, in file order of
the entries with two turns or more, so the test can check the picking rule offline without the tokenizer.
"""

import hashlib
import importlib.metadata
import json
import sys

from vllm.benchmarks.datasets import ShareGPTDataset
from vllm.tokenizers import get_tokenizer


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(tokenizer_dir: str, path: str, num: int, seed: int) -> None:
    tokenizer = get_tokenizer(tokenizer_dir, tokenizer_mode="auto", trust_remote_code=False)
    samples = ShareGPTDataset(random_seed=seed, dataset_path=path).sample(tokenizer=tokenizer, num_requests=num)
    with open(path, "rb") as f:
        raw = f.read()
    entries = [e for e in json.loads(raw) if len(e.get("conversations", [])) >= 2]
    counts = [[len(tokenizer(e["conversations"][k]["value"]).input_ids) for k in (0, 1)] for e in entries]
    head = {
        "vllm": importlib.metadata.version("vllm-cpu"),
        "tokenizer_sha256": hashlib.sha256(open(f"{tokenizer_dir}/tokenizer.json", "rb").read()).hexdigest()[:16],
        "dataset_sha256": hashlib.sha256(raw).hexdigest()[:16],
        "seed": seed,
        "num_prompts": num,
    }
    rows = [json.dumps([prompt_hash(s.prompt), s.prompt_len, s.expected_output_len]) for s in samples]
    sys.stdout.write(json.dumps(head)[:-1] + ',\n"counts": ' + json.dumps(counts, separators=(",", ":")))
    sys.stdout.write(',\n"picks": [\n' + ",\n".join(rows) + "\n]}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
