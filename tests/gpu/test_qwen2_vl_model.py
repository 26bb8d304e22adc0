"""Qwen2-VL and Qwen2.5-VL at the model level (issue 51): gpu/models/qwen2_vl.py and M-RoPE
(gpu/models/mrope.py) on the tiny checkpoints (conveyor/tiny/qwen2_vl.py) against transformers'
model classes on the same files.

The config adapter reads transformers 5's nested file and the Hub's flat one alike; each token's
three positions equal transformers' `get_rope_index`, over a whole prompt and over any chunk of it;
every position's logits equal transformers' `(input_ids, pixel_values, image_grid_thw)` forward,
several sequences in one paged pass and again in chunks cut through images (and, as a check that
the comparison can fail, not without the 3-D positions); both checkpoint layouts load the same
weights. The vision feature's side: a one-token prompt chunk on a placeholder, left to a decode
graph, runs eagerly, and a graphed pass's rows get their sequences' shifts.
tests/gpu/test_qwen2_vl.py drives the same families end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conveyor.config import ConfigError, ModelConfig
from conveyor.config.engine import EngineConfig, config_from_json, config_to_json
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.mrope import MRope
from conveyor.gpu.models.qwen2_vl import Qwen2VLForConditionalGeneration
from conveyor.gpu.models.registry import build_model, read_model_config
from conveyor.gpu.step.features.vision import VisionStep
from conveyor.gpu.step.passes import PassWork, WorkerSeq
from conveyor.gpu.step.step_inputs import PassInputs
from conveyor.tiny.qwen2_vl import make_qwen2_vl
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import SamplingParams

transformers = pytest.importorskip("transformers")

TEXT_IDS = 4096  # the tiny tokenizer's ids; the vision specials follow
BLOCK_SIZE = 4
CLASSES = {"2": "Qwen2VLForConditionalGeneration", "2.5": "Qwen2_5_VLForConditionalGeneration"}


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory, version) -> Path:
    return make_qwen2_vl(tmp_path_factory.mktemp(f"qwen{version}-vl"), version=version)


@pytest.fixture(scope="module")
def hf(path, version):
    return getattr(transformers, CLASSES[version]).from_pretrained(path).eval()


@pytest.fixture(scope="module")
def config(path) -> ModelConfig:
    return read_model_config(path)


@pytest.fixture(scope="module")
def model(config) -> Qwen2VLForConditionalGeneration:
    loaded = load_model(config, "cpu")
    assert isinstance(loaded, Qwen2VLForConditionalGeneration)
    return loaded


class Prompt:
    """Token ids [L] of text runs and images, the images' pixels and grids, and ImageInputs for them."""

    def __init__(self, path: Path, config: ModelConfig, pieces: list[int | Image.Image], seed: int) -> None:
        assert config.vision is not None
        processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
        pictures = [p for p in pieces if isinstance(p, Image.Image)]
        out = processor(pictures, return_tensors="pt") if pictures else {}
        self.pixels: torch.Tensor | None = out["pixel_values"] if pictures else None  # [patches, C*T*P*P]
        self.grids: torch.Tensor = out["image_grid_thw"] if pictures else torch.zeros(0, 3, dtype=torch.int64)  # [images, 3]
        gen = torch.Generator().manual_seed(seed)
        runs, self.images, at, i = [], [], 0, 0
        for p in pieces:
            if isinstance(p, int):
                runs.append(torch.randint(0, TEXT_IDS, (p,), generator=gen))
            else:
                grid = self.grids[i].tolist()
                n = grid[0] * grid[1] * grid[2] // 4
                runs.append(torch.full((n,), config.vision.image_token_id))
                self.images.append(ImageInput(hash=i, offset=at, length=n, pixels=b"", shape=[], grid=grid))
                i += 1
            at += len(runs[-1])
        self.ids = torch.cat(runs)
        self.mm = (self.ids == config.vision.image_token_id).int()


def merged(model: Qwen2VLForConditionalGeneration, prompt: Prompt) -> torch.Tensor:
    """The first layer's input [L, H]: text embeddings, each placeholder row its image's embedding."""
    x = model.embed(prompt.ids)
    if prompt.pixels is not None:
        sizes = [int(g.prod()) for g in prompt.grids]
        embeds = model.encode_images(list(prompt.pixels.split(sizes)), prompt.grids.tolist())
        x[prompt.mm.bool()] = torch.cat(embeds).to(x.dtype)
    return x


def rope_positions(model: Qwen2VLForConditionalGeneration, prompt: Prompt) -> torch.Tensor:
    """[3, L]: the layout's positions, or the index on all three rows without images."""
    assert model.mrope is not None
    layout = model.mrope.layout(prompt.images)
    n = len(prompt.ids)
    if layout is None:
        return torch.arange(n).expand(3, n)
    return torch.from_numpy(np.ascontiguousarray(layout.positions(0, n)))


def paged_logits(
    model, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], chunks: list[list[int]]
) -> list[torch.Tensor]:
    """Each sequence's logits [L, V] at every position: seqs are (ids [L], input embeds [L, H],
    rope positions [3, L] or None: plain positions), computed in passes over all of them, pass j
    taking sequence i's tokens up to chunks[i][j] through the paged cache."""
    attn, lens = model.backend.attn, [len(s[0]) for s in seqs]
    num_blocks = [-(-n // BLOCK_SIZE) for n in lens]
    caches = attn.allocate_kv_caches(sum(num_blocks), BLOCK_SIZE)
    free = list(range(sum(num_blocks)))[::-1]  # descending block ids: tables not in order
    tables = torch.zeros(len(seqs), max(num_blocks), dtype=torch.int32)
    for i, n in enumerate(num_blocks):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    for j in range(max(len(c) for c in chunks)):
        ends = [c[j] if j < len(c) else done[i] for i, c in enumerate(chunks)]
        spans = [(done[i], ends[i]) for i in range(len(seqs))]
        positions = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        meta = attn.build_metadata([hi - lo for lo, hi in spans], ends, tables, positions, BLOCK_SIZE, None)
        ids = torch.cat([s[0][lo:hi] for s, (lo, hi) in zip(seqs, spans)])
        embeds = torch.cat([s[1][lo:hi] for s, (lo, hi) in zip(seqs, spans)])
        rope = None
        if any(s[2] is not None for s in seqs):
            rope = torch.cat(
                [(s[2] if s[2] is not None else torch.arange(len(s[0])).expand(3, -1))[:, lo:hi] for s, (lo, hi) in zip(seqs, spans)],
                1,
            )
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, meta, caches, input_embeds=embeds, rope_positions=rope))
        for i, part in enumerate(logits.split([hi - lo for lo, hi in spans])):
            out[i].append(part)
        done = ends
    return [torch.cat(parts) for parts in out]


def hf_logits(hf, prompt: Prompt) -> torch.Tensor:
    kwargs = (
        {}
        if prompt.pixels is None
        else {"pixel_values": prompt.pixels, "image_grid_thw": prompt.grids, "mm_token_type_ids": prompt.mm[None]}
    )
    with torch.no_grad():
        return hf(input_ids=prompt.ids[None], **kwargs).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_read_model_config_takes_both_files(path, config, tmp_path):
    """transformers 5's nested file (what the tiny writer and save_pretrained write) and the Hub's
    flat one (rope_scaling {"type": "mrope"}) give the same config; it travels in the JSON config."""
    hf_config = json.loads((path / "config.json").read_text())
    text = hf_config["text_config"]
    assert config.architecture == hf_config["architectures"][0]
    assert (config.hidden_size, config.num_layers, config.qkv_bias, config.o_bias) == (
        text["hidden_size"],
        text["num_hidden_layers"],
        True,
        False,
    )
    assert dict(config.rope_scaling) == {"rope_type": "default", "mrope_section": (4, 6, 6)}
    assert config.vision is not None and config.vision.tower == hf_config["model_type"]
    assert config.vision.image_token_id == transformers.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|image_pad|>")
    rope = text.pop("rope_parameters")
    flat = {**{k: v for k, v in hf_config.items() if k != "text_config"}, **{k: v for k, v in text.items() if k != "model_type"}}
    flat |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(flat))
    hub = read_model_config(tmp_path)
    assert {**vars(hub), "path": "", "served_name": ""} == {**vars(config), "path": "", "served_name": ""}
    assert config_from_json(config_to_json(EngineConfig(model=config))).model == config
    with torch.device("meta"):
        assert isinstance(build_model(config), Qwen2VLForConditionalGeneration)


@pytest.mark.parametrize("section, match", [([4, 6], "sum to head_dim / 2"), (None, "no mrope_section")])
def test_a_bad_mrope_section_is_refused(path, tmp_path, section, match):
    hf_config = json.loads((path / "config.json").read_text())
    rope = hf_config["text_config"]["rope_parameters"]
    if section is None:
        del rope["mrope_section"]
    else:
        rope["mrope_section"] = section
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ConfigError, match=match):
        read_model_config(tmp_path)


def test_positions_equal_get_rope_index_whole_and_in_chunks(path, config, hf, model):
    """Text, a non-square image, text, a square one, and an image last; and the same positions
    from any chunk of the prompt."""
    prompt = Prompt(path, config, [5, picture(70, 40, 1), 3, picture(56, 56, 2), 4, picture(40, 100, 3)], seed=1)
    want, delta = hf.model.get_rope_index(prompt.ids[None], prompt.mm[None], prompt.grids)
    got = rope_positions(model, prompt)
    assert torch.equal(got, want[:, 0])
    assert model.mrope is not None
    layout = model.mrope.layout(prompt.images)
    assert layout is not None and layout.delta == int(delta)
    n = len(prompt.ids)
    for start in range(0, n, 3):
        for num in (1, 4, 11):
            num = min(num, n + 2 - start)  # past the end: decode tokens at p + delta
            expected = np.concatenate([got.numpy(), np.arange(n, n + 2)[None].repeat(3, 0) + layout.delta], 1)
            assert np.array_equal(layout.positions(start, num), expected[:, start : start + num]), (start, num)


def test_mrope_with_equal_positions_is_the_ordinary_rotary(model):
    """The section gather of one table row per token: three equal rows give the table's own rows."""
    assert model.mrope is not None
    positions = torch.tensor([0, 7, 3, 50])
    table = model.mrope.table(model.rope.cos_sin, positions.expand(3, -1), model._columns)
    assert torch.equal(table.cos_sin, model.rope.cos_sin[positions])
    assert MRope((4, 6, 6), 2).column_rows().tolist() == ([0] * 4 + [1] * 6 + [2] * 6) * 2


def test_prompt_logits_equal_transformers(path, config, hf, model):
    """Three sequences in one pass (two images, one image, none), then in chunks of which some end
    inside an image: every position's logits equal transformers'. Without the 3-D positions the
    rows from the first image on do not."""
    two = Prompt(path, config, [5, picture(70, 40, 4), 3, picture(40, 90, 5), 4], seed=2)
    one = Prompt(path, config, [picture(64, 64, 6), 7], seed=3)
    none = Prompt(path, config, [9], seed=4)
    prompts = (two, one, none)
    seqs = [(p.ids, merged(model, p), rope_positions(model, p) if p.images else None) for p in prompts]
    want = [hf_logits(hf, p) for p in prompts]
    lens = [len(p.ids) for p in prompts]
    whole = paged_logits(model, seqs, [[n] for n in lens])
    inside = [two.images[0].offset + 2, one.images[0].offset + 3]  # a chunk ends inside each first image
    chunked = paged_logits(model, seqs, [[inside[0], lens[0]], [inside[1], lens[1]], [4, lens[2]]])
    for got_whole, got_chunked, ref in zip(whole, chunked, want, strict=True):
        assert_logits_close(got_whole, ref)
        assert_logits_close(got_chunked, ref)
    flat = paged_logits(model, [(s[0], s[1], None) for s in seqs[:1]], [[lens[0]]])[0]
    first = two.images[0].offset
    torch.testing.assert_close(flat[:first], want[0][:first], atol=1e-4, rtol=1e-4)  # text before any image: the same
    assert (flat[first:] - want[0][first:]).abs().max() > 1e-2 * want[0].abs().max()


def test_encode_images_equals_get_image_features(path, config, hf, model):
    prompt = Prompt(path, config, [picture(70, 40, 7), picture(56, 56, 8), picture(31, 90, 9)], seed=5)
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=prompt.pixels, image_grid_thw=prompt.grids).pooler_output
        sizes = [int(g.prod()) for g in prompt.grids]
        got = model.encode_images(list(prompt.pixels.split(sizes)), prompt.grids.tolist())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_both_checkpoint_layouts_load_the_same_weights(path, config, hf, model):
    """The file (the Hub's names: model.*, visual.*) and transformers 5's module names
    (model.language_model.*, model.visual.*: its state_dict)."""
    saved = load_file(path / "model.safetensors")
    module = hf.state_dict()
    assert any(k.startswith("visual.") for k in saved) and any(k.startswith("model.visual.") for k in module)
    want = model.state_dict()
    for layout in (saved, module):
        with torch.device("meta"):
            loaded = build_model(config)
        loaded = loaded.to_empty(device="cpu")
        loaded.load_weights(layout.items())
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    without = {k: v for k, v in saved.items() if not k.startswith("visual.merger.mlp.2")}
    with pytest.raises(ConfigError, match=r"visual\.merger\.mlp\.2"):
        build_model(config).load_weights(without.items())


class Recorder:
    """A stand-in model for the vision feature: what embed and encode_images are asked."""

    def __init__(self, mrope: MRope | None, hidden: int = 4) -> None:
        self.mrope, self.hidden = mrope, hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        return [torch.ones(g[0] * g[1] * g[2] // 4, self.hidden) for g in grids]


def graphed_pass(rows: list[tuple[WorkerSeq, int]]) -> PassWork:
    """A pass left to a decode graph (no metadata): one token a row, ids all 0."""
    n = len(rows)
    inputs = PassInputs(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.tensor([seq.num_computed for seq, _ in rows]),
        meta=None,
        logit_index=torch.arange(n),
        slots=torch.arange(n),
        block_tables=torch.zeros(n, 1, dtype=torch.int32),
        num_rows=n,
        all_decode=True,
        seq_lens=[seq.num_computed + 1 for seq, _ in rows],
    )
    return PassWork(inputs, [seq for seq, _ in rows], [1] * n, list(range(n)), [[] for _ in rows])


def worker_seq(seq_id: int, num_tokens: int, num_computed: int) -> WorkerSeq:
    return WorkerSeq(seq_id, [0] * num_tokens, SamplingParams(), num_tokens, num_computed)


def test_a_graphed_pass_gets_each_rows_shift_or_runs_eagerly():
    """A graphed pass of text rows writes each row's shift (a text-only row 0, padding 0); one
    whose prompt chunk is a placeholder is given its metadata (eager) and the 3-D positions."""
    from conveyor.wire.step import NewSeq

    eager: list[PassInputs] = []

    def run_eagerly(inputs: PassInputs) -> None:  # as step_inputs.with_metadata: the pass gets metadata
        eager.append(inputs)
        inputs.meta = object()  # type: ignore[assignment]

    step = VisionStep(Recorder(MRope((4, 6, 6), 2)), torch.device("cpu"), run_eagerly, max_rows=4)
    image = ImageInput(
        hash=1, offset=2, length=6, pixels=np.zeros((24, 3 * 2 * 14 * 14), np.float32).tobytes(), shape=[24, 1176], grid=[1, 4, 6]
    )
    with_image, text = worker_seq(1, 12, 10), worker_seq(2, 5, 4)
    step.register(with_image, NewSeq(1, [0] * 12, SamplingParams(), 12, images=[image]))
    step.register(text, NewSeq(2, [0] * 5, SamplingParams(), 5))
    fork = WorkerSeq(3, [0] * 12, SamplingParams(), 12, 10, rope_layout=with_image.rope_layout)  # as advance() copies a parent
    step.register(fork, None)
    assert with_image.rope_layout is not None and with_image.rope_layout.delta == 3 - 6 and text.rope_layout is None
    work = graphed_pass([(with_image, 1), (text, 1), (fork, 1)])
    step.begin_pass(work)
    assert not eager and work.inputs.rope_positions is None and work.inputs.input_embeds is None
    assert step.graph_shift is not None and step.graph_shift.tolist() == [-3, 0, -3, 0]
    step.begin_pass(graphed_pass([(text, 1)]))  # a text-only pass after: the shifts go back to 0
    assert step.graph_shift.tolist() == [0, 0, 0, 0]
    prompt = worker_seq(4, 12, 3)  # its next token is its image's second placeholder
    step.register(prompt, NewSeq(4, [0] * 12, SamplingParams(), 12, images=[image]))
    work = graphed_pass([(text, 1), (prompt, 1)])
    step.begin_pass(work)
    assert eager == [work.inputs] and work.inputs.input_embeds is not None
    assert work.inputs.rope_positions is not None and work.inputs.rope_positions.tolist() == [[4, 2], [4, 2], [4, 3]]
