"""Security: a Ray that kvbatch starts listens on loopback only, with no dashboard; manifest and
config values are data, never code or shell. (Scratch removal never following symlinks is
tests/test_scratch.py::test_sweep_never_follows_symlinks.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import REPO, TINY_CONFIG, export_rows, kvbatch, write_jsonl

_LISTENERS = """
import json, os, time, psutil
from runner.cluster import ray_session
with ray_session(None):
    time.sleep(2)  # agents start listening shortly after ray.init returns
    ours = {p.pid: p.name() for p in psutil.Process().children(recursive=True)} | {os.getpid(): "driver"}
    print(json.dumps([[c.laddr.ip, c.laddr.port, ours[c.pid]] for c in psutil.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN and c.pid in ours]))
"""


def test_a_ray_started_by_kvbatch_listens_on_loopback_only_without_dashboard() -> None:
    proc = subprocess.run([sys.executable, "-c", _LISTENERS], cwd=REPO, capture_output=True, text=True,
                          timeout=180, check=True)
    listeners = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for _, _, name in listeners}
    assert "gcs_server" in names and "raylet" in names  # the processes were really seen
    exposed = [(ip, port, name) for ip, port, name in listeners if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert not any(port == 8265 for _, port, _ in listeners)  # the dashboard's web UI is not started


def test_shell_metacharacters_in_ids_paths_prompts_and_config_are_plain_data(tmp_path: Path, ray_address: str) -> None:
    canary = tmp_path / "pwned"
    attack = f"$(touch {canary}); `touch {canary}`; touch {canary} | true && echo"
    in_names = "$(touch pwned) `touch pwned`"  # a path component cannot hold the canary's slashes
    docs = tmp_path / f"docs {in_names}"
    docs.mkdir()
    odd_file = docs / "a;b|c&d`e`.txt"
    odd_file.write_text("A document whose name is full of shell syntax.\n" * 5)
    rows = [
        {"id": attack, "text": "Inline text.", "prompt": attack + " {__import__('os').system('id')}"},
        {"id": "file;rm -rf /", "path": str(odd_file), "note": "${HOME} %(x)s {0}"},
    ]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    job = tmp_path / f"job {in_names}"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
            "--set", f"summarize.prompt={attack}", "--set", f"cache.offload_root={tmp_path / ('off ' + in_names)}", check=0)
    assert not canary.exists()
    rows_out = {r["doc_id"]: r for r in export_rows(job)}
    assert set(rows_out) == {attack, "file;rm -rf /"} and {r["status"] for r in rows_out.values()} == {"done"}
    assert rows_out["file;rm -rf /"]["note"] == "${HOME} %(x)s {0}"  # metadata passed through verbatim
    assert json.loads((job / "job.json").read_text())["config"]["summarize"]["prompt"] == attack
    assert not any(p.exists() for p in (canary, REPO / "pwned", tmp_path / "pwned", docs / "pwned"))
