"""Gemma 3 with images at the model level (issue 51): gpu/models/gemma3_vl.py on the tiny checkpoint
(conveyor/tiny/gemma3_vl.py) against transformers' Gemma3ForConditionalGeneration on the same files.

Prompts are built by hand (text ids around runs of image soft tokens, each run framed by boi/eoi as
Gemma 3's processor frames it) and run as the worker runs them: paged passes over several
sequences, the placeholder rows replaced by `encode_images`' output, each pass carrying its rows'
extents (an image row sees its whole image: gpu/backends/extents.py), whole or in chunks that end
only between images. Logits at every position must equal transformers' forward with
`token_type_ids` (its bidirectional image mask, on the windowed and the global layers), on the
torch and the cpu (C++) backends, in float32 and with an fp8 cache within its rounding; the same
passes without extents equal transformers' causal forward and differ from the bidirectional one
(so the bidirectional part is checked); both checkpoint layouts load the same weights.
tests/gpu/test_gemma3_vl.py drives the family end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conveyor.config import ConfigError, ModelConfig
from conveyor.gpu.backends import select, torch_backend
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.gemma3_vl import Gemma3ForConditionalGeneration
from conveyor.gpu.models.multimodal import VisionModel
from conveyor.gpu.models.registry import read_model_config
from conveyor.tiny.gemma3_vl import IMAGE_TOKENS, SLIDING_WINDOW, make_gemma3_vl

transformers = pytest.importorskip("transformers")

TEXT_IDS = 4096  # the tiny tokenizer's ids; the specials follow
BLOCK_SIZE = 4


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))


@pytest.fixture(scope="module")
def hf(path):
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture(scope="module")
def config(path) -> ModelConfig:
    return read_model_config(path)


@pytest.fixture(scope="module", params=["torch", "cpu"])
def model(request, config) -> Gemma3ForConditionalGeneration:
    backend = torch_backend(config, "cpu") if request.param == "torch" else select("cpu", "cpu", config)
    loaded = load_model(config, "cpu", backend)
    assert isinstance(loaded, Gemma3ForConditionalGeneration) and isinstance(loaded, VisionModel)
    return loaded


def pixels_of(path: Path, *images: Image.Image) -> torch.Tensor:
    return transformers.Gemma3ImageProcessorPil.from_pretrained(path)(list(images), return_tensors="pt")["pixel_values"]


def prompt(path: Path, pieces: list[int | str], seed: int) -> torch.Tensor:
    """Token ids [L]: n random text ids for each int, boi + IMAGE_TOKENS soft tokens + eoi for each "image"."""
    hf_config = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    frame = [hf_config["boi_token_index"], *[hf_config["image_token_index"]] * IMAGE_TOKENS, hf_config["eoi_token_index"]]
    runs = [torch.tensor(frame) if p == "image" else torch.randint(0, TEXT_IDS, (int(p),), generator=gen) for p in pieces]
    return torch.cat(runs)


def extents_of(ids: torch.Tensor, image_token: int) -> torch.Tensor:
    """[L] int32: position + 1, or the end of the run of image tokens the row is in."""
    extents = torch.arange(1, len(ids) + 1, dtype=torch.int32)
    is_image = (ids == image_token).tolist()
    end = len(ids)
    for t in range(len(ids) - 1, -1, -1):
        if not is_image[t]:
            end = t
        elif t + 1 == len(ids) or not is_image[t + 1]:
            end = t + 1
        if is_image[t]:
            extents[t] = end
    return extents


def merged(model: Gemma3ForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    x = model.embed(ids)
    if pixels is not None:
        assert model.config.vision is not None
        x[ids == model.config.vision.image_token_id] = torch.cat(model.encode_images(list(pixels), [[] for _ in pixels])).to(x.dtype)
    return x


def paged_logits(model, seqs: list[tuple[torch.Tensor, torch.Tensor]], chunks: list[list[int]], *, bidirectional: bool = True):
    """Each sequence's logits [L, V]: seqs are (ids, input embeds), pass j taking sequence i's
    tokens up to chunks[i][j]; each pass with its rows' extents unless `bidirectional` is False."""
    attn, lens = model.backend.attn, [len(ids) for ids, _ in seqs]
    num_blocks = [-(-n // BLOCK_SIZE) for n in lens]
    caches = attn.allocate_kv_caches(sum(num_blocks), BLOCK_SIZE)
    free = list(range(sum(num_blocks)))[::-1]
    tables = torch.zeros(len(seqs), max(num_blocks), dtype=torch.int32)
    for i, n in enumerate(num_blocks):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    image_token = model.config.vision.image_token_id
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    for j in range(max(len(c) for c in chunks)):
        ends = [c[j] if j < len(c) else done[i] for i, c in enumerate(chunks)]
        spans = [(done[i], ends[i]) for i in range(len(seqs))]
        rows = [i for i, (lo, hi) in enumerate(spans) if hi > lo]
        positions = torch.cat([torch.arange(*spans[i]) for i in rows])
        meta = attn.build_metadata(
            [spans[i][1] - spans[i][0] for i in rows],
            [ends[i] for i in rows],
            tables[rows],
            positions,
            BLOCK_SIZE,
            model.config.sliding_window,
        )
        if bidirectional:
            meta.extents = torch.cat([extents_of(seqs[i][0], image_token)[slice(*spans[i])] for i in rows])
        ids = torch.cat([seqs[i][0][slice(*spans[i])] for i in rows])
        embeds = torch.cat([seqs[i][1][slice(*spans[i])] for i in rows])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, meta, caches, input_embeds=embeds))
        for i, part in zip(rows, logits.split([spans[i][1] - spans[i][0] for i in rows])):
            out[i].append(part)
        done = ends
    return [torch.cat(parts) for parts in out]


def hf_logits(hf, ids: torch.Tensor, pixels: torch.Tensor | None, *, token_types: bool = True) -> torch.Tensor:
    types = (ids == hf.config.image_token_id).long()[None] if token_types else None
    with torch.no_grad():
        return hf(input_ids=ids[None], pixel_values=pixels, token_type_ids=types).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= rel * want.abs().max()


def test_read_model_config_takes_the_checkpoint(path, config):
    hf_config = json.loads((path / "config.json").read_text())
    vision = config.vision
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.qk_norm and config.tie_word_embeddings
    assert config.layer_windows == (SLIDING_WINDOW, None, SLIDING_WINDOW) and config.local_rope_theta == 100.0
    assert vision is not None and vision.tower == "siglip"
    assert (vision.image_size, vision.patch_size, vision.tokens_per_image) == (64, 8, IMAGE_TOKENS)
    assert vision.image_token_id == hf_config["image_token_index"]


def test_every_position_equals_transformers_with_its_image_mask(path, hf, model):
    """Two sequences in one paged pass: two images (the second past the window of the first) and
    one; every position's logits equal transformers' bidirectional-image forward."""
    a = prompt(path, [5, "image", 7, "image", 4], seed=1)
    b = prompt(path, [3, "image", 9], seed=2)
    pa, pb = pixels_of(path, picture(70, 50, 1), picture(40, 90, 2)), pixels_of(path, picture(64, 64, 3))
    got = paged_logits(model, [(a, merged(model, a, pa)), (b, merged(model, b, pb))], [[len(a)], [len(b)]])
    assert_logits_close(got[0], hf_logits(hf, a, pa))
    assert_logits_close(got[1], hf_logits(hf, b, pb))


def test_chunks_that_end_between_images_equal_one_pass(path, hf, model):
    """A prompt in chunks cut before, between and after its images (never inside one), beside
    another sequence's chunks."""
    a = prompt(path, [5, "image", 7, "image", 4], seed=3)
    b = prompt(path, [9, "image", 2], seed=4)
    pa, pb = pixels_of(path, picture(33, 77, 5), picture(77, 33, 6)), pixels_of(path, picture(50, 50, 7))
    image_a, image_b = 5 + 1 + IMAGE_TOKENS + 1, 9 + 1 + IMAGE_TOKENS
    chunks = [[3, image_a, image_a + 7 + 1 + IMAGE_TOKENS, len(a)], [2, image_b, len(b)]]
    got = paged_logits(model, [(a, merged(model, a, pa)), (b, merged(model, b, pb))], chunks)
    assert_logits_close(got[0], hf_logits(hf, a, pa))
    assert_logits_close(got[1], hf_logits(hf, b, pb))


def test_without_extents_the_passes_are_transformers_causal_forward(path, hf, model):
    """The bidirectional mask changes the logits from the image on; the same passes without
    extents are transformers' causal forward (no token_type_ids), so the extents are what differs."""
    ids = prompt(path, [4, "image", 8], seed=5)
    pixels = pixels_of(path, picture(60, 60, 8))
    causal = paged_logits(model, [(ids, merged(model, ids, pixels))], [[len(ids)]], bidirectional=False)[0]
    assert_logits_close(causal, hf_logits(hf, ids, pixels, token_types=False))
    bidirectional = hf_logits(hf, ids, pixels)
    first_image = 4 + 1  # boi is causal, the first soft token already sees the whole image
    assert torch.equal(bidirectional[:first_image], hf_logits(hf, ids, pixels, token_types=False)[:first_image])
    assert (bidirectional[first_image:] - causal[first_image:]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_causal_extents_read_an_fp8_cache_as_the_backend_does(path, config, name):
    """Extents of position + 1 through the generic path (`read_kv` of the backend's layout, fp8
    codes read back as code * scale) equal the backend's own fp8 attention."""
    backend = (
        torch_backend(config, "cpu", kv_dtype="float8_e4m3fn") if name == "torch" else select("cpu", "cpu", config, "float8_e4m3fn")
    )
    model = load_model(config, "cpu", backend)
    ids = prompt(path, [23], seed=6)
    x = merged(model, ids, None)
    causal = paged_logits(model, [(ids, x)], [[9, len(ids)]], bidirectional=False)[0]
    # no image token: every extent is position + 1, but the pass takes the generic path
    assert_logits_close(paged_logits(model, [(ids, x)], [[9, len(ids)]])[0], causal)


def test_both_checkpoint_layouts_load_the_same_weights(path, tmp_path, config):
    """transformers' module layout (model.language_model.*, model.vision_tower.vision_model.*,
    model.multi_modal_projector.*, lm_head.*) loads as its save layout does."""
    moved = tmp_path / "module-layout"
    moved.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    renames = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower.vision_model."))
    renames += (("multi_modal_projector.", "model.multi_modal_projector."),)
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        tensors[name] = tensor
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(tensors, moved / "model.safetensors")
    a = load_model(config, "cpu").state_dict()
    b = load_model(read_model_config(moved), "cpu").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pooling_that_is_no_square_is_refused(path, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.suffix == ".json":
            (bad / f.name).write_bytes(f.read_bytes())
    hf_config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf_config, "mm_tokens_per_image": 12}))
    with pytest.raises(ConfigError, match="mm_tokens_per_image 12"):
        read_model_config(bad)
