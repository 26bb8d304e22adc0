"""--speculative-config: vLLM's JSON read once, each bad config one clear error at start-up
(the Python API's dict the same), and the CLI's one line with a non-zero exit."""

from __future__ import annotations

import json

import pytest

from conveyor.config import ConfigError, config_from_json, config_to_json
from conveyor.config.speculative import DEFAULT_LOOKUP, SpeculativeConfig, parse_speculative_config
from conveyor.engine_config import build_engine_config
from tests.api.test_cli import serve

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def test_the_json_and_the_dict_give_one_config():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
    text += '"disable_by_batch_size": 8}'
    assert parse_speculative_config(text) == parse_speculative_config(json.loads(text)) == SpeculativeConfig("ngram", 4, 2, 5, 8)


def test_lookup_bounds_default_and_follow_each_other():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig("ngram", 3, *DEFAULT_LOOKUP)
    # One bound given: the other is the same (vLLM's rule).
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3}).prompt_lookup_max == 3
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "draft_length": "fixed"}).draft_length == "fixed"


@pytest.mark.parametrize(
    "value, says",
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "method 'eagle3' needs \"model\""),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer of at least 1"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_length": "greedy"}', "draft_length must be one of adaptive, fixed"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "is above"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}', "unknown keys draft_tp"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}', "takes no model"),
        ('["ngram"]', "must be a JSON object"),
        ("{method: ngram}", "is not JSON"),
    ],
)
def test_bad_configs_are_one_clear_error(value, says):
    with pytest.raises(ConfigError, match=says):
        parse_speculative_config(value)


def test_engine_config_carries_it_through_the_run_directory_json():
    config = build_engine_config("tiny", device="cpu", speculative_config=NGRAM)
    assert config.speculative == SpeculativeConfig("ngram", 2, *DEFAULT_LOOKUP)
    assert config_from_json(config_to_json(config)).speculative == config.speculative
    assert build_engine_config("tiny", device="cpu").speculative is None


def test_multi_step_windows_are_refused_with_it():
    with pytest.raises(ConfigError, match="num-scheduler-steps above 1 cannot be combined"):
        build_engine_config(
            "tiny", device="cpu", num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 1}
        )


def test_the_cli_says_one_line_and_exits_non_zero():
    r = serve("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "num_speculative_tokens must be an integer of at least 1" in r.stderr
