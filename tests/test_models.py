"""Model loading with real models: the seeded tiny Llama, the builtin SmolLM2, folders and hub ids."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.config import ModelConfig
from runner.engine.model_loader import LoadedModel, load_model, resolve_device
from runner.engine.model_registry import ModelLoadError, builtin_cache_dir, builtin_model_dir

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(name="builtin:tiny-random")


def _run_python(code: str, env_overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_overrides}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _chat_answer(loaded: LoadedModel, question: str, max_new_tokens: int) -> str:
    tok = loaded.tokenizer
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    ).to(loaded.device)
    with torch.no_grad():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


COMMON_WORDS = frozenset(
    "the a an of to in on and or is are was were be it its this that with for as by at from "
    "not but there their they he she we you i can has have had which who what".split()
)


def _is_plain_english(text: str) -> bool:
    """Mostly ASCII words, a fair share of them the commonest English ones: true of a real answer,
    false of a random model's word salad (which may still be made of real word pieces)."""
    words = [w.strip(".,!?;:'\"()").lower() for w in text.split()]
    if len(words) < 3:
        return False
    ascii_words = sum(bool(re.fullmatch(r"[a-z]+", w)) for w in words)
    common = sum(w in COMMON_WORDS for w in words)
    return ascii_words / len(words) >= 0.8 and common / len(words) >= 0.2


def test_import_is_cheap() -> None:
    proc = _run_python(
        "import sys, runner.engine.model_loader, runner.engine.model_registry; print(sorted({'ray', 'torch', 'transformers'} & set(sys.modules)))", {}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_tiny_random_is_identical_on_every_load_and_generates() -> None:
    first = load_model(TINY)
    second = load_model(TINY)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.self_attn.q_proj.weight"].std() > 0

    assert first.name == "builtin:tiny-random"
    assert first.device == torch.device("cpu") and first.dtype == torch.float32
    assert not first.model.training
    assert first.model.config.num_key_value_heads < first.model.config.num_attention_heads
    assert first.tokenizer.chat_template
    assert first.model.generation_config.pad_token_id == first.tokenizer.pad_token_id is not None

    tok = first.tokenizer
    inputs = tok(["a short document", "another, slightly longer document here"], return_tensors="pt", padding=True)
    out = first.model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 6)


def test_tiny_random_continuations_depend_on_the_context() -> None:
    """Tests comparing KV cache strategies rely on this: a cache that loses a position changes the tokens."""
    loaded = load_model(TINY)
    tok = loaded.tokenizer

    def continuation(text: str) -> list[int]:
        ids = tok(text, return_tensors="pt")
        out = loaded.model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        return out[0, ids["input_ids"].shape[1]:].tolist()

    base = "The tenant pays the rent on the first day of each month. " * 4
    a, b = continuation(base), continuation("A" + base)
    assert a != b
    assert len(set(a)) >= 8, tok.decode(a)


def test_tiny_random_leaves_the_callers_random_stream_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    load_model(TINY)
    assert torch.equal(torch.rand(4), expected)


def test_explicit_dtype_is_applied() -> None:
    loaded = load_model(ModelConfig(name="builtin:tiny-random", dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_local_folder_loads_by_path(tmp_path: Path) -> None:
    tiny = load_model(TINY)
    folder = tmp_path / "my-model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)

    loaded = load_model(ModelConfig(name=str(folder)))
    assert loaded.name == str(folder)
    expected = tiny.model.state_dict()
    got = loaded.model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert loaded.tokenizer.chat_template == tiny.tokenizer.chat_template


def test_missing_local_folder_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        load_model(ModelConfig(name=str(missing)))


def test_unknown_builtin_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="builtin:nope.*builtin:smollm2-135m.*builtin:tiny-random"):
        load_model(ModelConfig(name="builtin:nope"))


def test_unknown_hub_id_offline_names_the_model(tmp_path: Path) -> None:
    # a fresh process, so HF_HUB_OFFLINE is read at import like in a real run; an empty HF cache
    code = (
        "from jobs.config import ModelConfig\n"
        "from runner.engine.model_registry import ModelLoadError\n"
        "from runner.engine.model_loader import load_model\n"
        "try:\n"
        "    load_model(ModelConfig(name='kvbatch-test/definitely-not-cached'))\n"
        "except ModelLoadError as e:\n"
        "    print('ERROR:', e)\n"
    )
    proc = _run_python(code, {"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ERROR:")
    assert "kvbatch-test/definitely-not-cached" in proc.stdout
    assert "HF_HUB_OFFLINE" in proc.stdout


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ModelLoadError, match="'gpu-please' is not a device"):
        resolve_device("gpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="'cuda:0' asks for CUDA"):
            resolve_device("cuda:0")


def test_builtin_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVBATCH_CACHE_DIR", str(tmp_path))
    assert builtin_cache_dir() == tmp_path
    monkeypatch.delenv("KVBATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtin_cache_dir() == tmp_path / "xdg" / "kvbatch" / "models"


def test_concurrent_first_loads_convert_once(tmp_path: Path) -> None:
    """Several workers starting together on a cold cache: one converts, the others wait and reuse it."""
    code = (
        "import hashlib\n"
        "from jobs.config import ModelConfig\n"
        "from runner.engine.model_loader import load_model\n"
        "m = load_model(ModelConfig(name='builtin:tiny-random')).model\n"
        "h = hashlib.sha256()\n"
        "for k, v in sorted(m.state_dict().items()):\n"
        "    h.update(k.encode()); h.update(v.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVBATCH_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [err for _, err, _ in results]
    assert len({out.strip() for out, _, _ in results}) == 1
    stderr = "".join(err for _, err, _ in results)
    assert stderr.count("extracting the SmolLM2 tokenizer") == 1
    converted = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(converted) == 1 and (converted[0] / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.slow
def test_smollm2_loads_from_its_cache_and_answers_in_english() -> None:
    cfg = ModelConfig(name="builtin:smollm2-135m")
    load_model(cfg)  # converts on a cold cache
    converted = builtin_model_dir(cfg.name)  # what code loading the same weights without kvbatch opens
    assert converted.parent == builtin_cache_dir()
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()

    loaded = load_model(cfg)
    assert loaded.model.name_or_path == str(converted)
    assert loaded.model.config.num_hidden_layers == 30
    assert loaded.model.config.num_key_value_heads == 3
    assert {p.dtype for p in loaded.model.parameters()} == {loaded.dtype}

    answer = _chat_answer(loaded, "What is the capital of France?", max_new_tokens=24)
    assert "Paris" in answer, answer
    assert _is_plain_english(answer), answer


def test_only_a_converted_builtin_has_a_model_folder() -> None:
    with pytest.raises(ModelLoadError, match="tiny-random' has no converted folder"):
        builtin_model_dir("builtin:tiny-random")


def test_plain_english_check_rejects_a_random_model() -> None:
    """The check above must be able to fail: on random tokens and on the random model's answer."""
    tiny = load_model(TINY)
    answer = _chat_answer(tiny, "What is the capital of France?", max_new_tokens=24)
    assert not _is_plain_english(answer), answer
    random_ids = torch.randint(0, len(tiny.tokenizer), (24,), generator=torch.Generator().manual_seed(0))
    random_text = tiny.tokenizer.decode(random_ids, skip_special_tokens=True)
    assert not _is_plain_english(random_text), random_text
