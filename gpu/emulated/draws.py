"""Emulated draws: deterministic ids from the tokenizer's ordinary vocabulary.

`EmulatedDraws` serves the emulated platform's `draw`: the same arguments and the same DeviceSamples
as the sampler's, whose device work it replaces; its host work is one pass over the draws, as
draw_step's own bookkeeping is (gpu/sampling/draws.py). The ordinary vocabulary is every id of
the tokenizer that is not a special token (so no EOS, no chat markup) and that the logits hold.

Invariants:
- a draw's id is the ordinary vocabulary's entry at a hash of (its sequence's key, its choice
  index, its output position); the key hashes its request's seed (0 unseeded) and its prompt
  (its length, its first and last _EDGE ids), so a repeated request repeats its answer whatever
  the batch, and the n choices of one request differ;
- a draw obeys its grammar's bitmask and min_tokens as on a model (no EOS, no stop id before
  min_tokens outputs); one with nothing left to draw fails;
- every logprob is a uniform draw's, -ln N, the sampled id first among the top logprobs.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from conveyor.gpu.sampling.draws import DeviceSamples, SamplingRow
from conveyor.gpu.structured import TokenMask

_EDGE = 16  # prompt ids at each end that a sequence's key hashes
_MAX_KEYS = 8192  # cached sequence keys before the cache starts again


class EmulatedDraws:
    """Draws for the emulated device. Lengths therefore end requests (max_tokens, ignore_eos or
    not), and stop strings end them where the text happens to hold one. A constrained draw whose
    id its grammar's bitmask forbids takes the allowed id the same hash picks instead (a complete
    grammar allows only EOS, so the answer ends there)."""

    def __init__(self, ordinary_ids: np.ndarray, vocab_size: int) -> None:
        if len(ordinary_ids) == 0:
            raise ValueError("the tokenizer has no ordinary (non-special) ids to draw")
        self.ordinary = ordinary_ids.astype(np.int64)  # [N] ascending
        self.vocab_size = vocab_size
        self.logprob = -math.log(len(ordinary_ids))
        # id(token_ids) -> (token_ids, key): holding the list keeps its id from being reused.
        self._keys: dict[int, tuple[list[int], int]] = {}

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...], draw_params, mask: TokenMask | None
    ) -> DeviceSamples:
        constrained = {} if mask is None else {int(r): i for i, r in enumerate(mask.rows.tolist())}
        keys: list[int] = []
        choices: list[int] = []
        positions: list[int] = []
        draw_rows: list[int] = []
        checked: list[tuple[int, int, tuple[int, ...]]] = []  # (draw, row, banned): a grammar or min_tokens may change it
        for r, row in enumerate(rows):
            key, position, params = self._key(row), row.num_output_tokens, row.params
            banned = eos_token_ids + tuple(params.stop_token_ids) if position < params.min_tokens else ()
            # Ordinary ids are never EOS: only a grammar, or a stop id, can offer what min_tokens bans.
            check = r in constrained or bool(banned and params.stop_token_ids)
            for choice in row.choice_indices:
                if check:
                    checked.append((len(keys), r, banned))
                keys.append(key)
                choices.append(choice)
                positions.append(position)
                draw_rows.append(r)
        hashes = _mix(np.array(keys, dtype=np.uint64), np.array(choices, dtype=np.uint64), np.array(positions, dtype=np.uint64))
        ids = self.ordinary[hashes % np.uint64(len(self.ordinary))]  # [N]
        valid = np.ones(len(ids), dtype=bool)
        for d, r, banned in checked:
            allowed = self._allowed(mask, constrained.get(r), banned)
            if allowed is None or ids[d] in allowed:
                continue
            if len(allowed) == 0:
                ids[d], valid[d] = 0, False
            else:
                ids[d] = allowed[int(hashes[d] % np.uint64(len(allowed)))]
        wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
        top_values = top_ids = None
        k = max((rows[r].params.logprobs or 0 for r in wanted), default=0)
        if k > 0:
            first = [draw_rows.index(r) for r in wanted]  # each row's own draw: its top ids
            tops = [
                [int(ids[d])] + [int(self.ordinary[(int(hashes[d]) + j) % len(self.ordinary)]) for j in range(1, k)] for d in first
            ]
            top_ids = torch.tensor(tops, dtype=torch.int64)
            top_values = torch.full((len(wanted), k), self.logprob, dtype=torch.float32)
        return DeviceSamples(
            token_ids=torch.from_numpy(ids),
            logprobs=torch.full((len(ids),), self.logprob, dtype=torch.float32),
            valid=torch.from_numpy(valid),
            top_values=top_values,
            top_ids=top_ids,
            rows=rows,
            wanted=wanted,
        )

    def _key(self, row: SamplingRow) -> int:
        cached = self._keys.get(id(row.token_ids))
        if cached is not None and cached[0] is row.token_ids:
            return cached[1]
        n = row.num_prompt_tokens
        prompt = row.token_ids[:n]
        edges = np.array([row.params.seed or 0, n, *prompt[:_EDGE], *prompt[-_EDGE:]], dtype=np.int64)
        key = int.from_bytes(hashlib.blake2b(edges.tobytes(), digest_size=8).digest(), "little")
        if len(self._keys) >= _MAX_KEYS:
            self._keys.clear()
        self._keys[id(row.token_ids)] = (row.token_ids, key)
        return key

    def _allowed(self, mask: TokenMask | None, mask_row: int | None, banned: tuple[int, ...]) -> np.ndarray | None:
        """The ids a draw may take: its grammar's (mask_row of the mask; None: any ordinary id),
        less `banned`. None: nothing restricts it."""
        if mask_row is None and not banned:
            return None
        if mask is None or mask_row is None:
            allowed = self.ordinary
        else:
            words = mask.bitmask[mask_row].numpy().view(np.uint8)  # [W] int32 -> [4W] bytes, little-endian bits
            allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[: self.vocab_size])
        return np.setdiff1d(allowed, np.array(banned, dtype=np.int64)) if banned else allowed


def _mix(keys: np.ndarray, choices: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A 64-bit hash (splitmix64's finaliser) of each (key, choice, position), [N] uint64."""
    with np.errstate(over="ignore"):
        x = keys ^ (choices * np.uint64(0x9E3779B97F4A7C15)) ^ (positions * np.uint64(0xD1B54A32D192ED03))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
