"""LoraConfig: the LoRA adapters an engine serves beside its base weights (vLLM's flags).

`--enable-lora` turns it on; `--lora-modules name=path ...` are served from the start, and
/v1/load_lora_adapter adds more while serving. `--max-loras` adapters are resident on the device
at once, each in a slot preallocated at `--max-lora-rank` (so a step never allocates), and
`--max-cpu-loras` are kept in host memory; the rest are read again from disk when asked for.
Each adapter is checked where it is named (config/lora_adapter.py): a bad one is refused then.
"""

from __future__ import annotations

import dataclasses

from conveyor.config.errors import ConfigError
from conveyor.config.options import option


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = option(False, "serve LoRA adapters beside the base model (a request picks one by its model name)")
    lora_modules: tuple[str, ...] = option((), "adapters served from the start, as name=path (a PEFT adapter directory)", none="none")
    max_loras: int = option(1, "adapters resident on the device at once (slots preallocated at --max-lora-rank)", minimum=1)
    max_lora_rank: int = option(16, "the largest adapter rank served", minimum=1)
    max_cpu_loras: int | None = option(None, "adapters kept in host memory", none="--max-loras", minimum=1)

    def __post_init__(self) -> None:
        if not self.enable_lora and self.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def modules(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs; a ConfigError for one not written name=path."""
        pairs = []
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: write name=path")
            pairs.append((name, path))
        return pairs
