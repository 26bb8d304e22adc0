"""expand_placeholders: each image marker becomes its run of placeholder tokens, in order; a
marker count that differs from the image count is refused."""

from __future__ import annotations

import pytest

from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.images import expand_placeholders
from conveyor.stages.tokenizer.preparation import Rejected
from conveyor.tiny.checkpoint import make_config
from conveyor.tiny.tokenizer import SPECIAL_TOKEN_IDS

IMG = 99


def test_each_marker_becomes_its_image_run_in_order():
    ids, offsets = expand_placeholders([1, IMG, 2, 3, IMG, 4], IMG, [3, 2])
    assert ids == [1, IMG, IMG, IMG, 2, 3, IMG, IMG, 4]
    assert offsets == [1, 6]
    for offset, count in zip(offsets, [3, 2]):
        assert ids[offset : offset + count] == [IMG] * count


def test_markers_at_the_ends_and_side_by_side():
    ids, offsets = expand_placeholders([IMG, IMG, 5, IMG], IMG, [2, 1, 3])
    assert ids == [IMG, IMG, IMG, 5, IMG, IMG, IMG]
    assert offsets == [0, 2, 4]


def test_a_text_only_prompt_passes_unchanged():
    assert expand_placeholders([1, 2, 3], IMG, []) == ([1, 2, 3], [])


@pytest.mark.parametrize("ids,counts", [([1, IMG, 2], []), ([1, 2], [4]), ([IMG, IMG], [4]), ([IMG], [4, 4])])
def test_a_marker_count_unlike_the_image_count_is_refused(ids, counts):
    with pytest.raises(Rejected, match=f"{ids.count(IMG)} image placeholder.*for {len(counts)} image") as caught:
        expand_placeholders(ids, IMG, counts, param="prompt")
    assert caught.value.param == "prompt"


def test_image_marker_text_typed_by_a_user_is_no_marker(tmp_path):
    # The template's own markup yields the special id; the same text in content is plain text
    # (encoder.py), so it cannot add an image slot the request has no image for.
    marker = "<|reserved_special_token_0|>"
    template = "{% for m in messages %}" + marker + "{{ m['content'] }}{% endfor %}"
    encoder = PromptEncoder(make_config(tmp_path), chat_template=template)
    ids = encoder.encode_chat([{"role": "user", "content": f"look {marker} here"}], False)
    image_id = SPECIAL_TOKEN_IDS[marker]
    assert ids.count(image_id) == 1
    expanded, offsets = expand_placeholders(ids, image_id, [5])
    assert expanded.count(image_id) == 5 and offsets == [ids.index(image_id)]
