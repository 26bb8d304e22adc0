"""LLaVA-1.5 at the model level (issue 51): gpu/models/llava.py on the tiny checkpoint
(conveyor/tiny/vision.py) against transformers' LlavaForConditionalGeneration on the same files.

The prompts are built by hand (text ids around runs of `<image>` placeholders) and run as the
worker runs them: one paged forward over several sequences, the placeholder rows of the text
embeddings replaced by `encode_images`' output (the `input_embeds` seam of CausalLM.forward), and
also in two chunks whose boundary falls inside an image. Logits must equal transformers'
`(input_ids, pixel_values)` forward; another picture must change them (after the image only);
both checkpoint layouts load the same weights; a variant with the "full" strategy and two feature
layers (one the embeddings) holds too; and two tensor-parallel ranks (gloo, forked), the tower
replicated, give the unsharded logits. tests/gpu/test_llava.py drives the same family end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conveyor.config import ConfigError, ModelConfig
from conveyor.gpu.backends import torch_backend
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.llava import LlavaForConditionalGeneration
from conveyor.gpu.models.multimodal import VisionModel
from conveyor.gpu.models.registry import build_model, read_model_config
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import shard_model_config
from conveyor.tiny.vision import make_llava
from tests.gpu.test_tensor_parallel import gloo_rank, run_forked

transformers = pytest.importorskip("transformers")

TEXT_IDS = 4096  # the tiny tokenizer's ids; <image> is the next one
BLOCK_SIZE = 4


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(path):
    return transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def config(path) -> ModelConfig:
    return read_model_config(path)


@pytest.fixture(scope="module")
def model(config) -> LlavaForConditionalGeneration:
    loaded = load_model(config, "cpu")
    assert isinstance(loaded, LlavaForConditionalGeneration)
    return loaded


def pixels_of(path: Path, *images: Image.Image) -> torch.Tensor:
    """[N, 3, 56, 56]: the checkpoint's CLIP preprocessing (PIL: torchvision is not here)."""
    processor = transformers.CLIPImageProcessorPil.from_pretrained(path)
    return processor(list(images), return_tensors="pt")["pixel_values"]


def prompt(config: ModelConfig, pieces: list[int | str], seed: int) -> torch.Tensor:
    """Token ids [L]: n random text ids for each int in `pieces`, one image's placeholders for each "image"."""
    assert config.vision is not None
    gen = torch.Generator().manual_seed(seed)
    runs = [
        torch.full((config.vision.tokens_per_image,), config.vision.image_token_id)
        if p == "image"
        else torch.randint(0, TEXT_IDS, (int(p),), generator=gen)
        for p in pieces
    ]
    return torch.cat(runs)


def merged(model: LlavaForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    """The first layer's input [L, H]: text embeddings, each placeholder row its image's embedding, in order."""
    x = model.embed(ids)
    if pixels is not None:
        embeds = model.encode_images(list(pixels), [[] for _ in pixels])
        assert model.config.vision is not None
        x[ids == model.config.vision.image_token_id] = torch.cat(embeds).to(x.dtype)
    return x


def paged_logits(
    model: LlavaForConditionalGeneration, seqs: list[tuple[torch.Tensor, torch.Tensor]], chunks: list[list[int]]
) -> list[torch.Tensor]:
    """Each sequence's logits [L, V] at every position: seqs are (ids [L], input embeds [L, H]),
    computed in passes over all of them, pass j taking sequence i's tokens up to chunks[i][j]
    (the attention backend's paged cache carrying the earlier passes' keys and values)."""
    attn, lens = model.backend.attn, [len(ids) for ids, _ in seqs]
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
        meta = attn.build_metadata([hi - lo for lo, hi in spans], ends, tables, positions, BLOCK_SIZE, model.config.sliding_window)
        ids = torch.cat([s[0][lo:hi] for s, (lo, hi) in zip(seqs, spans)])
        embeds = torch.cat([s[1][lo:hi] for s, (lo, hi) in zip(seqs, spans)])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, meta, caches, input_embeds=embeds))
        for i, part in enumerate(logits.split([hi - lo for lo, hi in spans])):
            out[i].append(part)
        done = ends
    return [torch.cat(parts) for parts in out]


def hf_logits(hf, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None], pixel_values=pixels).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_read_model_config_and_build_model_take_the_checkpoint(path, config):
    hf_config = json.loads((path / "config.json").read_text())
    vision, text = hf_config["vision_config"], hf_config["text_config"]
    assert config.architecture == "LlavaForConditionalGeneration"
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (
        text["hidden_size"],
        text["num_hidden_layers"],
        text["vocab_size"],
    )
    assert config.vision is not None
    assert (config.vision.hidden_size, config.vision.num_layers, config.vision.image_size, config.vision.patch_size) == (
        vision["hidden_size"],
        vision["num_hidden_layers"],
        vision["image_size"],
        vision["patch_size"],
    )
    assert config.vision.tokens_per_image == hf_config["image_seq_length"] == 16
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert config.vision.image_token_id == hf_config["image_token_index"] == tokenizer.convert_tokens_to_ids("<image>")
    with torch.device("meta"):
        built = build_model(config)
    assert isinstance(built, LlavaForConditionalGeneration) and isinstance(built, VisionModel)


def test_a_vision_config_the_model_cannot_run_is_refused(path, tmp_path):
    hf_config = json.loads((path / "config.json").read_text())
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    siglip = {**hf_config, "vision_config": {**hf_config["vision_config"], "model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(siglip))
    with pytest.raises(ConfigError, match="siglip_vision_model"):
        read_model_config(tmp_path)


def test_encode_images_equals_get_image_features(path, hf, model):
    pixels = pixels_of(path, picture(70, 40, 1), picture(56, 56, 2), picture(31, 90, 3))
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixels).pooler_output
        got = model.encode_images(list(pixels), [[], [], []])
    assert [tuple(g.shape) for g in got] == [(16, model.config.hidden_size)] * 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_prompt_logits_equal_transformers(path, hf, config, model):
    """Three sequences in one pass (two images, one image, none), then the same again in chunks of
    which two end inside an image: every position's logits equal transformers'."""
    two = prompt(config, [5, "image", 3, "image", 4], seed=1)  # 44 tokens
    one = prompt(config, ["image", 7], seed=2)  # 23
    none = prompt(config, [9], seed=3)
    pixels = [pixels_of(path, picture(70, 40, 4), picture(40, 90, 5)), pixels_of(path, picture(64, 64, 6)), None]
    seqs = [(ids, merged(model, ids, p)) for ids, p in zip((two, one, none), pixels)]
    want = [hf_logits(hf, ids, p) for (ids, _), p in zip(seqs, pixels)]
    whole = paged_logits(model, seqs, [[44], [23], [9]])
    chunked = paged_logits(model, seqs, [[12, 30, 44], [10, 23], [4, 9]])  # 12, 30, 10: inside an image
    for got_whole, got_chunked, ref in zip(whole, chunked, want, strict=True):
        assert_logits_close(got_whole, ref)
        assert_logits_close(got_chunked, ref)


def test_another_image_changes_the_logits_after_it(path, config, model):
    ids = prompt(config, [6, "image", 5], seed=4)
    a, b = (
        paged_logits(model, [(ids, merged(model, ids, pixels_of(path, image)))], [[len(ids)]])[0]
        for image in (picture(60, 60, 7), picture(60, 60, 8))
    )
    torch.testing.assert_close(a[:6], b[:6])  # causal: the text before the image does not see it
    after = (a[6:] - b[6:]).abs().amax(dim=-1)  # each row after the first placeholder
    assert bool((after > 1e-2 * a.abs().max()).all()), after
    assert a[-1].argmax() != b[-1].argmax()  # the next token, too


def empty_model(config: ModelConfig) -> LlavaForConditionalGeneration:
    with torch.device("meta"):
        built = build_model(config)
    built = built.to_empty(device="cpu")
    assert isinstance(built, LlavaForConditionalGeneration)
    return built


def test_both_checkpoint_layouts_load_the_same_weights(path, hf, config, model):
    """The file (transformers' save names, with CLIPVisionModel's `vision_model.`), transformers'
    module names (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`: its state_dict),
    and the save names without `vision_model.`."""
    saved = load_file(path / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in saved) and any(k.startswith("vision_tower.vision_model.") for k in saved)
    module = hf.state_dict()
    assert any(k.startswith("model.language_model.") for k in module) and "lm_head.weight" in module
    bare = {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in saved.items()}
    want = model.state_dict()
    for layout in (saved, module, bare):
        loaded = empty_model(config)
        loaded.load_weights(layout.items())
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    without = {k: v for k, v in saved.items() if "multi_modal_projector.linear_2" not in k}
    with pytest.raises(ConfigError, match=r"multi_modal_projector\.linear_2"):
        empty_model(config).load_weights(without.items())


def test_full_strategy_and_two_feature_layers(path, tmp_path):
    """vision_feature_select_strategy "full" (the class token kept: 17 embeddings an image) and
    vision_feature_layer [0, -1] (the embeddings after the pre-norm, and the last layer's output,
    concatenated): a checkpoint transformers writes with save_pretrained."""
    hf_config = transformers.LlavaConfig.from_pretrained(path)
    hf_config.vision_feature_select_strategy = "full"
    hf_config.vision_feature_layer = [0, -1]
    hf_config.image_seq_length = 17
    torch.manual_seed(0)
    ref = transformers.LlavaForConditionalGeneration(hf_config).eval()
    with torch.no_grad():  # HF draws at 0.02; at fan-in scale an image moves the logits
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    ref.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    config = read_model_config(tmp_path)
    assert config.vision is not None
    assert (config.vision.feature_select, config.vision.feature_layers, config.vision.tokens_per_image) == ("full", (0, -1), 17)
    ours = load_model(config, "cpu")
    assert isinstance(ours, LlavaForConditionalGeneration)
    pixels = pixels_of(path, picture(50, 70, 9), picture(56, 56, 10))
    with torch.no_grad():
        want = ref.model.get_image_features(pixel_values=pixels).pooler_output
    for g, w in zip(ours.encode_images(list(pixels), [[], []]), want, strict=True):
        assert g.shape == (17, config.hidden_size)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    ids = prompt(config, [3, "image", 2, "image", 5], seed=5)
    got = paged_logits(ours, [(ids, merged(ours, ids, pixels))], [[20, len(ids)]])[0]
    assert_logits_close(got, hf_logits(ref, ids, pixels))


def run_tensor_parallel(tp: TensorParallel, path: str) -> dict[str, torch.Tensor]:
    """This rank's image embeddings and (rank 0: [L, V]; others [L, 0]) chunked prompt logits."""
    config = read_model_config(path)
    backend = dataclasses.replace(torch_backend(shard_model_config(config, tp.size), "cpu"), tp=tp)
    model = load_model(config, "cpu", backend)
    assert isinstance(model, LlavaForConditionalGeneration)
    pixels = pixels_of(Path(path), picture(70, 40, 11), picture(48, 64, 12))
    ids = prompt(config, [5, "image", 3, "image", 4], seed=6)
    embeds = merged(model, ids, pixels)
    return {"images": embeds[ids == config.vision.image_token_id], "logits": paged_logits(model, [(ids, embeds)], [[14, 44]])[0]}  # type: ignore[union-attr]


def _rank_main(rank: int, size: int, store: str, path: str, out: str) -> None:
    with gloo_rank(rank, size, store) as tp:
        torch.save(run_tensor_parallel(tp, path), out)


def test_two_ranks_replicate_the_tower_and_equal_the_whole_model(path, tmp_path):
    whole = run_tensor_parallel(SINGLE, str(path))
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    run_forked(_rank_main, [(r, 2, str(tmp_path / "store"), str(path), str(outs[r])) for r in range(2)], 120)
    ranks = [torch.load(out) for out in outs]
    for rank in ranks:  # the tower and projector are whole on each rank: the same embeddings
        torch.testing.assert_close(rank["images"], whole["images"], atol=1e-5, rtol=1e-5)
    assert ranks[1]["logits"].shape[-1] == 0  # rank 0 samples
    torch.testing.assert_close(ranks[0]["logits"], whole["logits"], atol=1e-4, rtol=1e-4)
