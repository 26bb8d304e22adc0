"""Frozen configuration, built once at launch and passed down to every stage.

Values found at run time (the number of KV blocks) travel as messages, never as mutations.
"""

from conveyor.config.engine import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    ServerConfig,
    StagesConfig,
    config_from_json,
    config_to_json,
)
from conveyor.config.errors import ConfigError
from conveyor.config.media import MediaConfig, accepts_images
from conveyor.config.model import ModelConfig
from conveyor.config.moe import MoeConfig

__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "MediaConfig",
    "ModelConfig",
    "MoeConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
    "ServerConfig",
    "StagesConfig",
    "accepts_images",
    "config_from_json",
    "config_to_json",
]
