"""Speculative decoding on the worker: proposers of draft tokens (ngram.py) and their
verification (verify.py). The scheduler decides which rows may speculate and reserves their
slots (stages/scheduler/speculation.py); docs/architecture.md ("Speculative decoding") walks
through a step."""

from conveyor.gpu.spec.ngram import NgramProposer
from conveyor.gpu.spec.verify import accepted_length

__all__ = ["NgramProposer", "accepted_length"]
