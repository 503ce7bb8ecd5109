"""A prompt chunk riding the static step (issue 48): what one decode step of pool rows costs the host
with a joining prompt's chunk beside it, the two ways the engine can run it.

- `riding`: one eager `mixed_step` over the decode rows and the chunk (the step whenever a prompt
  rode before issue 48, and with `batch.static_step: off` still);
- `split`: the static step over the decode rows (the riding prompt's slot a passenger) and the chunk
  as its own eager forward (`BatchEngine._step`, with `batch.static_step` on);
- and, without a chunk, the static step alone and `mixed_step` alone (a decode step's own cost);
- the default config's token choice (the summary's 4-gram ban, with word pieces: every row has a
  repeat banned, every other one a word start, so the glue rule runs) made after the static step on
  the host from its logits, as before issue 48 (`NoRepeatNGrams.apply`, then the argmax), or inside the
  step (`StaticStep.run` with the rows' bans, an in-step scatter and argmax); each ends with the one
  `tolist()` that brings the tokens to the host.

Host ms is the step's wall time on the CPU (the least of `--steps`, after a warm-up), which on the
CPU includes the kernels' own work; `ops` counts the aten ops dispatched (bench/step_ops.py's
`OpCounter`), `launching` those that launch work on a device. Every step starts from the same cache
lengths (they are set back after it), so each variant times the same step.

    python -m bench.static_split --model shaped --rows 4 16
    python -m bench.static_split --model builtin:smollm2-135m --rows 16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from bench.step_ops import OpCounter, shaped_model
from jobs.config import ModelConfig
from runner.engine.batched_logits import NoRepeatNGrams
from runner.engine.kvcache import ResidentMeter
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import load_model
from runner.engine.ragged import PrefillChunk, mixed_step
from runner.engine.static_step import StaticStep
from runner.engine.word_pieces import WordPieces

CHUNK = 256
"""A riding chunk's tokens (`batch.prefill_chunk_tokens`' default)."""


def _model(name: str) -> PreTrainedModel:
    if name == "shaped":  # Llama-3-8B's attention shape, a small width: host-bound, as on a GPU (fp32: the
        return shaped_model().float()  # CPU's bf16 attention over a 256-token chunk takes seconds)
    return load_model(ModelConfig(name=name, device="cpu", dtype="float32")).model


class _Batch:
    """`rows` pool rows of `prompt` tokens each, and a riding prompt with `prompt` tokens in."""

    def __init__(self, model: PreTrainedModel, rows: int, prompt: int) -> None:
        self.model = model
        self.pool = KVPool.for_model(model.config, model.dtype, torch.device("cpu"), ResidentMeter(None, "device", ""))
        generator = torch.Generator().manual_seed(rows)
        vocab = model.config.vocab_size
        self.caches = [PooledCache(self.pool, prompt + 64) for _ in range(rows)]
        self.riding = PooledCache(self.pool, 2 * prompt + CHUNK)
        for cache in [*self.caches, self.riding]:
            ids = torch.randint(0, vocab, (1, prompt), generator=generator)
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=cache, use_cache=True)
        self.chunk_ids = torch.randint(0, vocab, (CHUNK,), generator=generator).tolist()
        self.tokens = torch.randint(0, vocab, (rows,), generator=generator).tolist()
        # the default token choice: each row's summary so far holds a 4-gram its last three tokens repeat
        vocab = model.config.vocab_size
        self.pieces = WordPieces([" w" if i % 2 == 0 else "x" for i in range(vocab)])
        self.forms = [NoRepeatNGrams(4, [], self.pieces) for _ in range(rows)]
        for row, form in enumerate(self.forms):
            gram = [7, 9, 11, 2 * row + (row % 2)]  # the banned follower: a word start on every other row
            for token in [*gram, 5, *gram[:3]]:
                form.note(token)
        self.vocab = vocab
        self.static = StaticStep(model, self.pool, graphs=False, pieces=self.pieces)
        self.lengths = [cache.length for cache in [*self.caches, self.riding]]

    def chunk(self) -> PrefillChunk:
        return PrefillChunk(self.riding, self.chunk_ids, self.riding.length, wants_logits=False)

    def riding_step(self) -> None:
        mixed_step(self.model, self.tokens, [c.length for c in self.caches], self.caches, self.chunk())

    def split_step(self) -> None:
        self.static.run(self.tokens, self.caches)
        mixed_step(self.model, [], [], [], self.chunk())

    def static_step(self) -> None:
        self.static.run(self.tokens, self.caches)

    def host_choice_step(self) -> None:
        logits, _ = self.static.run(self.tokens, self.caches)
        NoRepeatNGrams.apply(self.forms, logits).argmax(dim=-1).tolist()

    def in_step_choice_step(self) -> None:
        bans = [(form.banned(), form.glues(self.vocab)) for form in self.forms]
        _, tokens = self.static.run(self.tokens, self.caches, bans)
        tokens.tolist()

    def eager_step(self) -> None:
        mixed_step(self.model, self.tokens, [c.length for c in self.caches], self.caches, None)

    def reset(self) -> None:
        """Every cache back to its length before the step: the next one is the same step."""
        for cache, length in zip([*self.caches, self.riding], self.lengths):
            cache.length = length


def measure(batch: _Batch, step: Callable[[], None], steps: int) -> tuple[float, int, int]:
    """The least host ms of `steps` steps (after one warm-up), its aten ops and launching ops."""
    counter = OpCounter()
    with counter:
        step()
    batch.reset()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        best = min(best, (time.perf_counter() - t0) * 1e3)
        batch.reset()
    return best, counter.ops, counter.launching


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shaped", help="`shaped` or a model name (builtin:smollm2-135m)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--prompt", type=int, default=512, help="tokens each row and the riding prompt hold")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = _model(args.model)
    print(f"{args.model}, {model.dtype}, {args.threads} torch thread(s), rows of {args.prompt} tokens, "
          f"a {CHUNK}-token chunk riding")
    print("| rows | step | host ms | aten ops | launching ops |")
    print("|---:|---|---:|---:|---:|")
    for rows in args.rows:
        batch = _Batch(model, rows, args.prompt)
        for name, step in (("riding (one eager mixed_step)", batch.riding_step),
                           ("split (static step + chunk forward)", batch.split_step),
                           ("static step alone, no chunk", batch.static_step),
                           ("static step + the 4-gram ban's choice on the host", batch.host_choice_step),
                           ("static step with the 4-gram ban's choice in it", batch.in_step_choice_step),
                           ("eager mixed_step alone, no chunk", batch.eager_step)):
            ms, ops, launching = measure(batch, step, args.steps)
            print(f"| {rows} | {name} | {ms:.1f} | {ops} | {launching} |", flush=True)


if __name__ == "__main__":
    main()
