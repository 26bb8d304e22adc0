"""An EAGLE-3 head proposing (`{"method": "eagle3", "model": DIR}`), on random heads in the
published layout (conveyor.tiny.eagle3): a draft vocabulary that is a subset of the target's
(d2t), the head's own embedding table or the target's, model.safetensors or pytorch_model.bin.

The head's drafts are checked against a dense reference written here from the layout (the
target's hidden states from transformers, the head's one layer over the whole sequence, no
cache): the paged proposer, whose KV follows the target's passes and whose features come from
the target's own run, proposes the reference's drafts at every step. The drafts verified are an
oracle's (the run's own continuation, some broken), so follows cover accepted runs and rejected
tails. And the output is the engine's own without speculation, greedy and seeded, through
preemption and shared prefixes, on tiny Llama and Qwen2 and on SmolLM2. Bad heads are refused at
start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM
from conveyor.config import ConfigError
from conveyor.engine_config import build_engine_config
from conveyor.gpu.spec.eagle3 import Eagle3Proposer
from conveyor.gpu.step.features.speculation import SpeculationStep
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.tiny.eagle3 import make_eagle3_head
from conveyor.wire.messages import SamplingParams
from tests.gpu.test_spec_decode import Oracle


def _spec(llm) -> SpeculationStep:
    """The LLM's speculation feature (gpu/step/features/speculation.py)."""
    spec = llm.runner.feature(SpeculationStep)
    assert spec is not None
    return spec


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43, 44, 45] * 3, [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


def spec(head, k=3):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "draft_length": "fixed"}


def run(path, params, head=None, prompts=PROMPTS, **options):
    """Token ids per prompt, and the LLM. With a head, every row takes all k drafts its lookahead
    allows (these tests are about exactness, not pay)."""
    extra = {"speculative_config": spec(head)} if head is not None else {}
    llm = LLM(str(path), device="cpu", num_kv_blocks=options.pop("num_kv_blocks", 256), **extra, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def target(request, checkpoints):
    return checkpoints[request.param]


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    # The tiny checkpoints have 2 layers, too few for the layout's default (2, L // 2, L - 3).
    return make_eagle3_head(target, tmp_path_factory.mktemp("head"), seed=1, draft_vocab_size=1024, aux_layers=(1, 0, 1))


class Dense:
    """The layout's EAGLE-3 drafting, written plainly: transformers runs the target for its hidden
    states; the head's layer attends over the whole sequence, recomputed at each step."""

    def __init__(self, target, head_dir) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.w = load_file(str(head_dir / "model.safetensors"))
        n = self.model.config.num_hidden_layers
        self.layers = self.cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * self.w[f"{name}.weight"]

    def layer(self, embeds, features):
        """[T, H] each, positions 0..T-1 -> (normed, pre-norm) [T, H]."""
        w, heads, kv = self.w, self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        t, d = embeds.shape[0], self.cfg["hidden_size"] // heads
        x = torch.cat([self.rms(embeds, "midlayer.input_layernorm"), self.rms(features, "midlayer.hidden_norm")], -1)
        q, k, v = (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv")
        inv = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(t).float()[:, None] * inv[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

        def rope(x):
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        q, k, v = rope(q.view(t, heads, d)), rope(k.view(t, kv, d)), v.view(t, kv, d)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        h = out.transpose(0, 1).reshape(t, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T + features
        m = self.rms(h, "midlayer.post_attention_layernorm")
        mlp = F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
        out = mlp @ w["midlayer.mlp.down_proj.weight"].T + h
        return self.rms(out, "norm"), out

    @torch.no_grad()
    def drafts(self, ids: list[int], k: int) -> list[int]:
        """ids: the sequence so far, its last token not computed -> the head's k greedy drafts."""
        hs = self.model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        features = torch.cat([hs[i][0] for i in self.layers], -1) @ self.w["fc.weight"].T  # [T - 1, H]
        embed = self.model.get_input_embeddings()
        tokens, out = list(ids[1:]), []
        for _ in range(k):
            normed, prenorm = self.layer(embed(torch.tensor(tokens)), features)
            best = int((normed[-1] @ self.w["lm_head.weight"].T).argmax())
            out.append(best + int(self.w["d2t"][best]))
            tokens.append(out[-1])
            features = torch.cat([features, prenorm[-1:]])
        return out


def test_proposals_equal_the_dense_reference_through_accepted_and_rejected_drafts(target, head, monkeypatch):
    base, _ = run(target, GREEDY)
    oracle = Oracle(list(zip(PROMPTS, base)))
    seen: list[tuple[list[int], list[int]]] = []
    propose = Eagle3Proposer.propose

    def recording(self, seqs, slots, limits):
        drafts = propose(self, seqs, slots, limits)
        seen.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts) if d)
        verified = oracle.propose(seqs, slots, limits)
        # Every third proposal breaks the oracle's second draft: a run accepted, then a rejected tail.
        return [v[:1] + [(v[1] + 1) % 4096] + v[2:] if len(v) > 1 and len(seen) % 3 == 0 else v for v in verified]

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    got, llm = run(target, GREEDY, head=head, max_num_batched_tokens=10)  # the 11- and 18-token prompts in chunks
    assert got == base
    dense = Dense(target, head)
    assert len(seen) > 20
    mismatches = [(ids, d) for ids, d in seen if dense.drafts(ids, len(d)) != d]
    assert not mismatches, f"{len(mismatches)} of {len(seen)} proposals differ from the reference, first {mismatches[0]}"


def test_greedy_and_seeded_outputs_are_unchanged(target, head):
    base, _ = run(target, GREEDY)
    assert run(target, GREEDY, head=head)[0] == base
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=s, max_tokens=15) for s in range(len(PROMPTS))]
    assert run(target, params, head=head)[0] == run(target, params)[0]


def test_preemption_and_shared_prefixes(target, head):
    """Ten prompts sharing a long prefix through a pool of 24 blocks of 4: prefix-cache hits (a
    row starting past the features kept), copies on write and preemption."""
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] + [i, i + 1] for i in range(20, 30)]
    small = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    base, _ = run(target, GREEDY, prompts=prompts, **small)
    assert run(target, GREEDY, head=head, prompts=prompts, **small)[0] == base


@pytest.mark.parametrize("variant", ["own-embeddings", "torch-file", "full-vocabulary"])
def test_head_variants_of_the_layout_load_and_serve(checkpoints, tmp_path, variant):
    target = checkpoints["LlamaForCausalLM"]
    options = {
        "own-embeddings": dict(embed=True, draft_vocab_size=2048, aux_layers=(0, 1, 1)),
        "torch-file": dict(torch_file=True, draft_vocab_size=2048, aux_layers=(0, 1, 1)),
        "full-vocabulary": dict(aux_layers=(1, 1, 0)),
    }[variant]
    head = make_eagle3_head(target, tmp_path / "head", seed=2, **options)
    assert (head / ("pytorch_model.bin" if variant == "torch-file" else "model.safetensors")).is_file()
    base, _ = run(target, GREEDY)
    got, llm = run(target, GREEDY, head=head)
    assert got == base
    proposer = _spec(llm).drafter
    assert (proposer.head.embed_tokens is not None) == (variant == "own-embeddings")
    assert llm.runner.model.aux_layers == options["aux_layers"]


def test_smollm2_greedy_is_identical(smollm2, tmp_path):
    llm = LLM(device="cpu", num_kv_blocks=64)
    head = make_eagle3_head(Path(llm.config.model.path), tmp_path / "head", draft_vocab_size=4096)
    ids = [llm.encoder.encode_chat([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}])]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    spec_llm = LLM(device="cpu", num_kv_blocks=64, speculative_config=spec(head, 4))
    assert [o.outputs[0].token_ids for o in spec_llm.generate(ids, params)] == base
    assert spec_llm.runner.model.aux_layers == (2, 15, 27)  # SmolLM2's 30 layers: the layout's default


def refusal(target, head) -> str:
    with pytest.raises(ConfigError) as e:
        build_engine_config(str(target), device="cpu", speculative_config=spec(head))
    return str(e.value)


def test_bad_heads_are_refused_at_start(checkpoints, tmp_path):
    target = checkpoints["LlamaForCausalLM"]
    width = json.loads((target / "config.json").read_text())["hidden_size"]
    other = make_checkpoint(tmp_path / "other", hidden_size=2 * width, intermediate_size=4 * width)
    assert f"reads hidden states of width {2 * width}, the model's are {width}" in refusal(
        target, make_eagle3_head(other, tmp_path / "h1")
    )
    deep = make_eagle3_head(target, tmp_path / "h2", aux_layers=(0, 1, 9))
    assert "reads layers [0, 1, 9]; it needs three of the model's 2 layers" in refusal(target, deep)
    assert "reads layers [2, 1, -1]" in refusal(target, make_eagle3_head(target, tmp_path / "h4"))  # the default, too deep
    assert "is not an EAGLE-3 head" in refusal(target, target)


def test_a_head_whose_d2t_leaves_the_vocabulary_is_refused_at_load(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    target = checkpoints["LlamaForCausalLM"]
    head = make_eagle3_head(target, tmp_path / "head", draft_vocab_size=1024, aux_layers=(0, 1, 1))
    tensors = load_file(str(head / "model.safetensors"))
    tensors["d2t"][-1] = 4096  # draft id 1023 -> target id 5119
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ConfigError, match="d2t maps draft ids outside the model's 4096 tokens"):
        run(target, GREEDY, head=head)
