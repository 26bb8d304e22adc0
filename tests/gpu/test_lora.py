"""Multi-LoRA through the Python API on tiny Llama and Qwen2 checkpoints, against peft's PeftModel
on the same files: random non-zero adapters of ranks 8 and 16 on different target sets (one
rsLoRA), each alone and all in one mixed batch with the base; more adapters than slots (each waits
for one, none blocks the base); the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import functools

import pytest
import torch

from conveyor import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (rank, targets, rsLoRA)
    "attn8": (8, ["q_proj", "v_proj"], False),
    "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp8": (8, ["gate_proj", "up_proj", "down_proj"], True),
}
PROMPTS = ["The quick brown fox", "Hello, my name is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2]
NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def make_adapters(base, root) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    paths = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
        tuned = peft.get_peft_model(model, config)
        for name_, param in tuned.named_parameters():  # peft's own init leaves tiny deltas: make them count
            if "lora_" in name_:
                param.data.normal_(0, 0.3)
        tuned.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="module")
def adapters_of(checkpoints, tmp_path_factory):
    """arch -> (its checkpoint, its adapters' paths by name), made once."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = (checkpoints[arch], make_adapters(checkpoints[arch], tmp_path_factory.mktemp(arch)))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def setup(adapters_of):
    return adapters_of("LlamaForCausalLM")


@functools.cache
def reference_model(base, path: str | None):
    """transformers' model of `base`, with peft's adapter at `path` on it (None: the base alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if path is not None:
        model = peft.PeftModel.from_pretrained(model, path)
    return model.eval()


def peft_greedy(base, path: str | None, prompt_ids: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    model = reference_model(base, path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens)
    return out[0, len(prompt_ids) :].tolist()


CASES = [("LlamaForCausalLM", 1), ("LlamaForCausalLM", 4), ("Qwen2ForCausalLM", 1)]


@pytest.mark.parametrize("arch, steps", CASES, ids=["llama", "llama-multi-step", "qwen2"])
def test_each_adapter_and_a_mixed_batch_match_peft(adapters_of, arch, steps):
    base, paths = adapters_of(arch)
    options = dict(device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, num_kv_blocks=256, block_size=4)
    # A 16-token budget: the long prompt is chunked; multi-step windows decode 4 passes a plan.
    llm = LLM(str(base), **options, max_num_batched_tokens=16, num_scheduler_steps=steps)
    names = [None, *ADAPTERS]
    jobs = [(prompt, name) for prompt in PROMPTS for name in names]  # base + 3 adapters, 2 slots: some wait
    loras = [None if name is None else LoRARequest(name, paths[name]) for _, name in jobs]
    outs = llm.generate([p for p, _ in jobs], GREEDY, lora_request=loras)
    expected = {}
    for (prompt, name), out in zip(jobs, outs):
        key = (prompt, name)
        expected[key] = peft_greedy(base, None if name is None else paths[name], out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected[key], key
    for prompt in PROMPTS:  # the adapters do change the text
        assert len({tuple(expected[(prompt, name)]) for name in names}) == len(names), prompt
    assert llm.core.scheduler.adapters.num_evictions > 0  # three adapters through two slots
    (alone,) = llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("all16", paths["all16"]))
    assert alone.outputs[0].token_ids == expected[(PROMPTS[0], "all16")]


def test_the_prefix_cache_is_keyed_by_adapter(setup):
    base, paths = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256, block_size=4)
    prompt = PROMPTS[2]
    a, b = LoRARequest("attn8", paths["attn8"]), LoRARequest("all16", paths["all16"])
    (first,) = llm.generate(prompt, GREEDY, lora_request=a)
    (same,) = llm.generate(prompt, GREEDY, lora_request=a)
    (other,) = llm.generate(prompt, GREEDY, lora_request=b)
    (plain,) = llm.generate(prompt, GREEDY)
    assert same.num_cached_tokens > 0 and same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_refusals(setup, tmp_path):
    base, paths = setup
    plain = LLM(str(base), device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("x", GREEDY, lora_request=LoRARequest("attn8", paths["attn8"]))
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    with pytest.raises(ValueError, match="rank"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("all16", paths["all16"]))
    with pytest.raises(ValueError, match="adapter"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("none", str(tmp_path)))


def graphed_batch(base, paths: dict[str, str], dtype: str) -> tuple[list[str | None], list]:
    """The first prompt greedily for the base and every adapter, one batch on CUDA with graphs."""
    llm = LLM(str(base), device="cuda", dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=256)
    assert llm.runner.graphs is not None
    names = [None, *ADAPTERS]
    loras = [None if name is None else LoRARequest(name, paths[name]) for name in names]
    return names, llm.generate([PROMPTS[0]] * len(names), GREEDY, lora_request=loras)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_with_graphs_matches_peft(setup):
    """On CUDA the decode steps replay graphs whose projections read the static slots: greedy text
    of the base and of each adapter, in one batch, equal to peft's (float32)."""
    base, paths = setup
    names, outs = graphed_batch(base, paths, "float32")
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == peft_greedy(base, paths.get(name) if name else None, out.prompt_token_ids), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sgmv_with_graphs_matches_peft(setup, monkeypatch):
    """The same with the Triton backend's LoRA table at SGMV for every row count
    (triton/lora_groups.py): the decode graphs group their static slots by adapter on each replay."""
    from conveyor.gpu.backends.triton import lora_groups

    monkeypatch.setattr(lora_groups, "KERNEL_BY_ROWS", ((1, "sgmv"),))
    base, paths = setup
    names, outs = graphed_batch(base, paths, "float32")
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == peft_greedy(base, paths.get(name) if name else None, out.prompt_token_ids), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_with_graphs_is_within_rounding_of_peft(setup):
    """bf16 rounds differently in every implementation, so tokens may part ways: each token drawn
    greedily in one graphed batch (base and every adapter) is within 0.1 nats of the best choice
    of peft's model in bf16 on the same prefix, and each adapter's text differs from the base's."""
    from transformers import AutoModelForCausalLM

    base, paths = setup
    names, outs = graphed_batch(base, paths, "bfloat16")
    texts = {name: out.outputs[0].token_ids for name, out in zip(names, outs)}
    assert all(texts[name] != texts[None] for name in ADAPTERS), texts
    for name, out in zip(names, outs):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to("cuda")
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, paths[name])
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            logp = model.eval()(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
        steps = logp[len(out.prompt_token_ids) - 1 : -1]  # [8, V]: the distributions our tokens were drawn from
        chosen = steps.gather(-1, torch.tensor(out.outputs[0].token_ids, device="cuda")[:, None])
        assert (steps.max(-1, keepdim=True).values - chosen).max() < 0.1, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is off where CUDA is present: the cuda tests run the kernels")
def test_triton_sgmv_under_the_interpreter_matches_peft(setup, monkeypatch):
    """The Triton backend with its LoRA table at SGMV for every row count (triton/lora_groups.py):
    each pass's tokens grouped once (LoraPass.set_slots) and read by every projection; a batch of
    the base and two adapters, prompts and decodes, greedy tokens equal to peft's (float32)."""
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton import backend, lora_groups

    monkeypatch.setattr(lora_groups, "KERNEL_BY_ROWS", ((1, "sgmv"),))
    calls = []
    shrink = backend.sgmv_shrink
    monkeypatch.setattr(backend, "sgmv_shrink", lambda x, a, groups: calls.append(x.shape[0]) or shrink(x, a, groups))
    base, paths = setup
    llm = LLM(str(base), device="cpu", attention_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    names = [None, "attn8", "all16"]
    loras = [None if name is None else LoRARequest(name, paths[name]) for name in names]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * len(names), greedy, lora_request=loras)
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == peft_greedy(base, paths.get(name) if name else None, out.prompt_token_ids, 3), name
    assert calls, "the SGMV kernels did not run"
