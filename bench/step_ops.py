"""What one batched decode step and its token choice cost the host: aten ops, kernel-launching ops,
host ms, host syncs, by rows.

The model is Llama-3-8B's attention shape (32 layers, 32 query / 8 KV heads, head_dim 128) with a
small hidden and MLP width, random weights, bf16, 1 CPU thread, so a step runs in milliseconds and
its time is mostly the host work around the kernels, as on a GPU. The ops are counted where they
really run: a `TorchDispatchMode` sees every aten op one `decode_step` dispatches; the step's token
choice is counted apart (`choice_*`), each row's own `TokenPicker.pick` against the batch's
`choose_tokens`, with its host reads (scalar reads and `tolist()`: each one device-to-host sync).
"Kernel-launching" counts every op except views (`OpOverload.is_view`) and the ops that only make or
describe a tensor without touching its data (`METADATA_OPS`): on a GPU each counted op is at least
one kernel launch (or a copy). A tiered cache reads its layers ahead on its own IO thread, where a
dispatch mode of the compute thread does not see them: `io_*` counts those ops with a counter entered
on each tiered row's IO thread for the step (the reads it queued, the next step's first layer
included: one read per streamed layer per step). Host ms is the step's wall time on the CPU, so it
includes the kernels' own work there (attention over every row's KV grows with the rows on a CPU;
on a GPU it is the part that runs asynchronously); prompts are short (`PROMPT_TOKENS`) so that part
stays small. `compute ms` is the part of a step spent in the matmul and attention kernels (torch
profiler, the least of three steps), `other ms` the rest of the host time: the host work a GPU would not hide;
`wait ms` the part of the fastest step the compute thread spent waiting for tiered rows' layers to
be read (the caches' own `decode_wait_s`), inside `other ms`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from jobs.config import ModelConfig, SummarizeConfig
from runner.engine.batched_logits import ANY, NoRepeatNGrams
from runner.engine.generation import TokenPicker, choose_tokens
from runner.engine.kvcache import BudgetedDynamicCache, ResidentMeter, TieredCache
from runner.engine.kvcache.pool import KVPool, PooledCache
from runner.engine.model_loader import LoadedModel, load_model
from runner.engine.model_registry import word_tokenizer
from runner.engine.ragged import PrefillChunk, decode_step, mixed_step
from runner.engine.static_step import StaticStep
from runner.engine.word_pieces import WordPieces

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")
"""The kernels whose CPU time is the step's device work (weight matmuls, attention), by name prefix."""
METADATA_OPS = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "size", "stride",
                "sym_size", "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense_meta"}
ROWS = (1, 8, 32)
PROMPT_TOKENS = 32
CASES = (("dynamic", "per-row"), ("dynamic", "pooled"), ("tiered-host", "per-row"), ("tiered-host", "pooled"))


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched while active, those that launch work on the device, and the scalar
    reads by the host (int(), item(), bool(): each a sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launching = 0
        self.scalar_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        if not func.is_view and func.overloadpacket.__name__ not in METADATA_OPS:
            self.launching += 1
        self.scalar_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class ListReads(TorchFunctionMode):
    """tolist() calls: a copy to the host on a device, which dispatches no op on a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def shaped_model() -> PreTrainedModel:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=1024, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _caches(model: PreTrainedModel, strategy: str, attention: str, rows: int) -> tuple[list, list[int], KVPool | None]:
    """`rows` prefilled caches (distinct prompts), and their first tokens."""
    pool = (KVPool.for_model(model.config, torch.bfloat16, torch.device("cpu"), ResidentMeter(None, "device", ""))
            if (strategy, attention) == ("dynamic", "pooled") else None)
    make: Callable[[], Any] = {
        "dynamic": lambda: PooledCache(pool, PROMPT_TOKENS + 64) if pool else
        BudgetedDynamicCache(model.config, None, PROMPT_TOKENS + 64),
        "tiered-host": lambda: TieredCache(model.config, tier="host", batched_attention=attention == "pooled"),
    }[strategy]
    caches, first = [], []
    generator = torch.Generator().manual_seed(rows)
    for _ in range(rows):
        ids = torch.randint(0, 1024, (PROMPT_TOKENS,), generator=generator).tolist()
        cache = make()
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        first.append(int(logits[0, -1].argmax()))
        caches.append(cache)
    return caches, first, pool


def _pickers(model: PreTrainedModel, rows: int) -> list[TokenPicker]:
    """Plain greedy pickers (no logits processor), one a row, that never end within the bench."""
    loaded = LoadedModel(model, word_tokenizer(model.config.vocab_size), "step-ops", torch.device("cpu"),
                         torch.bfloat16, 0.0)
    return [TokenPicker(loaded, SummarizeConfig(generation={}, no_repeat_summary_ngram=0), [0] * PROMPT_TOKENS, 1 << 30) for _ in range(rows)]


class _Case:
    """One row of the table: its prefilled caches, and a decode step over them."""

    def __init__(self, model: PreTrainedModel, strategy: str, attention: str, rows: int) -> None:
        self.model, self.strategy, self.attention, self.rows = model, strategy, attention, rows
        self.caches, self.tokens, self.pool = _caches(model, strategy, attention, rows)
        self.positions = [PROMPT_TOKENS] * rows
        self.pickers = _pickers(model, rows)
        self.best_ms = float("inf")
        self.best_wait_ms = 0.0
        self.choice_best_ms = {"per-row": float("inf"), "batched": float("inf")}
        self.logits: torch.Tensor | None = None

    def step(self) -> None:
        self.logits = decode_step(self.model, self.tokens, self.positions, self.caches)
        self.positions = [p + 1 for p in self.positions]

    def choose(self, way: str) -> list[int]:
        """The last step's tokens, each row by its own picker (`per-row`) or the batch's (`batched`)."""
        if way == "per-row":
            return [picker.pick(self.logits[row : row + 1]) for row, picker in enumerate(self.pickers)]
        greedy = choose_tokens(self.pickers, self.logits)
        return [picker.take(greedy[row]) for row, picker in enumerate(self.pickers)]

    def counted_choice(self, way: str) -> tuple[OpCounter, int]:
        """The choice's ops and its host reads (scalar reads and tolist() calls)."""
        counter, lists = OpCounter(), ListReads()
        with lists, counter:
            self.choose(way)
        return counter, counter.scalar_reads + lists.count

    def timed_choice(self) -> None:
        for way in self.choice_best_ms:
            t0 = time.perf_counter()
            self.choose(way)
            self.choice_best_ms[way] = min(self.choice_best_ms[way], (time.perf_counter() - t0) * 1e3)

    def timed_step(self) -> None:
        waited = self._waited_s()
        t0 = time.perf_counter()
        self.step()
        ms = (time.perf_counter() - t0) * 1e3
        if ms < self.best_ms:
            self.best_ms, self.best_wait_ms = ms, (self._waited_s() - waited) * 1e3

    def _waited_s(self) -> float:
        """What the tiered rows' layers kept the compute thread waiting so far (their own counters)."""
        return sum(cache.shared.traffic.decode_wait_s for cache in self.caches if isinstance(cache, TieredCache))

    def counted_step(self) -> tuple[OpCounter, OpCounter]:
        """The step's ops on the compute thread, and on the tiered rows' IO threads (summed)."""
        counter = OpCounter()
        threads = [cache.shared.io(torch.device("cpu")) for cache in self.caches if isinstance(cache, TieredCache)]
        on_io = [OpCounter() for _ in threads]
        for io, io_counter in zip(threads, on_io):
            io.run(io_counter.__enter__)  # after the jobs already queued: the mode is this thread's own
        with counter:
            self.step()
        for io, io_counter in zip(threads, on_io):
            io.run(io_counter.__exit__, None, None, None)  # after the step's queued reads
        io_total = OpCounter()
        io_total.ops, io_total.launching = sum(c.ops for c in on_io), sum(c.launching for c in on_io)
        assert self.pool is None or self.pool.most_rows == self.rows, "the pooled path did not run"
        if self.strategy.startswith("tiered") and self.attention == "pooled":
            assert all(cache.most_batched_rows == self.rows for cache in self.caches), "the batched tiered path did not run"
        return counter, io_total

    def compute_ms(self, steps: int = 3) -> float:
        """The self CPU time of the step's matmul and attention kernels (torch profiler): the least
        of `steps` steps, each profiled alone (on a shared machine one step's kernels may be slowed)."""
        least = float("inf")
        for _ in range(steps):
            with torch.profiler.profile() as prof:
                self.step()
            least = min(least, sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith(COMPUTE_OPS)) / 1e3)
        return least

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


def step_ops(steps: int) -> dict[str, Any]:
    """The table and the 32-row / 1-row ratios of each case. Each case's host ms is its fastest of
    `steps` steps, the cases taking turns step by step, so they share the machine's state (on a
    shared machine the fastest is the least disturbed by other work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = shaped_model()
        cases = [_Case(model, strategy, attention, rows) for strategy, attention in CASES for rows in ROWS]
        for case in cases:
            case.step()  # warm-up
        counters = [case.counted_step() for case in cases]
        choices = [{way: case.counted_choice(way) for way in case.choice_best_ms} for case in cases]
        compute = [case.compute_ms() for case in cases]
        for _ in range(steps):
            for case in cases:
                case.timed_step()
                case.timed_choice()
        for case in cases:
            case.close()
    finally:
        torch.set_num_threads(before)
    table = [{"cache": case.strategy, "attention": case.attention, "rows": case.rows, "aten_ops": counter.ops,
              "launching_ops": counter.launching, "io_ops": io.ops, "io_launching_ops": io.launching,
              "launching_with_io": counter.launching + io.launching, "host_ms": case.best_ms, "compute_ms": kernels,
              "other_ms": max(case.best_ms - kernels, 0.0), "wait_ms": case.best_wait_ms,
              "launching_with_choice": counter.launching + choice["batched"][0].launching,
              **{f"choice_{key}_{way.replace('-', '_')}": value for way, (ops, reads) in choice.items()
                 for key, value in (("launching_ops", ops.launching), ("host_reads", reads),
                                    ("ms", case.choice_best_ms[way]))}}
             for case, (counter, io), kernels, choice in zip(cases, counters, compute, choices, strict=True)]
    ratios = []
    for strategy, attention in CASES:
        one, most = (next(r for r in table if (r["cache"], r["attention"], r["rows"]) == (strategy, attention, n))
                     for n in (ROWS[0], ROWS[-1]))
        ratios.append({"cache": strategy, "attention": attention,
                       "launching_ratio": most["launching_ops"] / one["launching_ops"],
                       "with_io_ratio": most["launching_with_io"] / one["launching_with_io"],
                       "with_choice_ratio": most["launching_with_choice"] / one["launching_with_choice"],
                       "host_ratio": most["host_ms"] / one["host_ms"],
                       "other_ratio": most["other_ms"] / one["other_ms"] if one["other_ms"] else float("nan")})
    return {"prompt_tokens": PROMPT_TOKENS, "table": table, "ratios": ratios}


# -- the static step with a riding chunk, and its token choice (run as a script) --------------------
# A prompt chunk riding the static step (issue 48): what one decode step of pool rows costs the host
# with a joining prompt's chunk beside it, the two ways the engine can run it.
#
# - `riding`: one eager `mixed_step` over the decode rows and the chunk (the step whenever a prompt
#   rode before issue 48, and with `batch.static_step: off` still);
# - `split`: the static step over the decode rows (the riding prompt's slot a passenger) and the chunk
#   as its own eager forward (`BatchEngine._step`, with `batch.static_step` on);
# - and, without a chunk, the static step alone and `mixed_step` alone (a decode step's own cost);
# - the default config's token choice (the summary's 4-gram ban, with word pieces: every row has a
#   repeat banned, every other one a word start, so the glue rule runs) made after the static step on
#   the host from its logits, as before issue 48 (`NoRepeatNGrams.apply`, then the argmax), or inside the
#   step (`StaticStep.run` with the rows' bans, an in-step scatter and argmax); each ends with the one
#   `tolist()` that brings the tokens to the host.
#
# Host ms is the step's wall time on the CPU (the least of `--steps`, after a warm-up), which on the
# CPU includes the kernels' own work; `ops` counts the aten ops dispatched (bench/step_ops.py's
# `OpCounter`), `launching` those that launch work on a device. Every step starts from the same cache
# lengths (they are set back after it), so each variant times the same step.
#
#     python bench/step_ops.py --model shaped --rows 4 16
#     python bench/step_ops.py --model builtin:smollm2-135m --rows 16

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
        bans = []
        for form in self.forms:  # TokenPicker.ban's
            banned = [t for t in form.banned() if t < self.vocab]
            bans.append([(ANY, banned, form.begins_word(banned))])
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
