"""The README and the tree's layout: CPU only, no torch, no GPU.

    python -m pytest -q tests/test_docs.py
"""
import importlib.util
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK_NAMES = ("results-table", "speed-of-light")
# A commit id as it appears in prose: 7-40 lowercase hex digits, at least one digit and one letter, a whole word.
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _readme_table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "tools" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(text):
    """Block name -> the README's text between its markers, found here independently of the tool."""
    out = {}
    for name in BLOCK_NAMES:
        found = re.findall(rf"<!-- {name}:begin -->\n?(.*?)\n?<!-- {name}:end -->", text, flags=re.S)
        assert len(found) == 1, f"README.md: one {name} block expected, got {len(found)}"
        out[name] = found[0]
    return out


def _tracked_and_untracked():
    """Files git tracks plus untracked files it does not ignore, relative to the repository root."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line and (ROOT / line).exists()]  # a deletion counts before its commit


def test_results_hold_one_run():
    """results/ holds the current run only: one results/<gpu>.json, its chart beside it."""
    runs = sorted((ROOT / "results").glob("*.json"))
    assert len(runs) == 1, f"one results/<gpu>.json expected, got {[r.name for r in runs]}"
    assert runs[0].with_suffix(".png").exists(), f"{runs[0].name}'s chart {runs[0].stem}.png is missing"


def test_readme_blocks_are_what_the_results_give():
    results = _readme_table().current_results(ROOT)
    rendered = _readme_table().render(json.loads(results.read_text(encoding="utf-8")))
    assert set(rendered) == set(BLOCK_NAMES)
    current = _blocks(README.read_text(encoding="utf-8"))
    for name in BLOCK_NAMES:
        assert current[name] == rendered[name], (
            f"README.md's {name} block is not what {results.name} gives: run python tools/readme_table.py")


def test_speed_of_light_names_where_its_rates_were_measured():
    """The H200's measured rates; the H100 SXM (same SMs and clocks) borrows them, saying so; another H100 gets none."""
    table = _readme_table()
    result = json.loads(table.current_results(ROOT).read_text(encoding="utf-8"))
    header = {}
    for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"):
        text = table.render_speed_of_light({**result, "device": device})
        header[device] = next(line for line in text.splitlines() if line.startswith("| precision"))
        assert ("767.0" in text) == (device != "NVIDIA H100 PCIe"), device
    assert "measured rate on this GPU" in header["NVIDIA H200"]
    assert "measured rate on the H200" in header["NVIDIA H100 80GB HBM3"]


def test_readme_is_short():
    data = README.read_bytes()
    lines = data.decode("utf-8").count("\n")
    assert lines <= 250, f"README.md: at most 250 lines expected, got {lines}"
    assert len(data) <= 30 * 1024, f"README.md: at most 30 KB expected, got {len(data)} bytes"


def test_readme_names_at_most_two_commits():
    ids = sorted(set(COMMIT_ID.findall(README.read_text(encoding="utf-8"))))
    assert len(ids) <= 2, f"README.md: at most 2 commit ids expected, got {len(ids)}: {', '.join(ids)}"


def test_commit_id_pattern():
    """The pattern the previous test counts with: hex words of 7-40 with a digit and a letter, nothing else."""
    text = "at 44eb74e and 1ac131c0ffee; not 8258048, deadbeefcafe, 0x7FC00000, sm90_tf32, 44eb74g or 44eb74"
    assert COMMIT_ID.findall(text) == ["44eb74e", "1ac131c0ffee"]


def test_results_folder_is_current_runs_only():
    files = _tracked_and_untracked()
    results = [f for f in files if f.startswith("results/")]
    assert len(results) <= 15, f"results/: at most 15 files expected, got {len(results)}"
    patches = [f for f in files if f.endswith((".patch", ".diff"))]
    assert not patches, f"no .patch or .diff files expected in the tree, got {', '.join(patches)}"


def test_design_doc_exists_and_docs_are_short():
    assert (ROOT / "docs" / "design.md").is_file(), "docs/design.md expected, got none"
    sizes = {p.name: p.read_text(encoding="utf-8").count("\n") for p in sorted((ROOT / "docs").glob("*.md"))}
    total = sum(sizes.values())
    assert total <= 1200, f"docs/*.md: at most 1,200 lines in all expected, got {total} ({sizes})"


def test_csrc_holds_the_sources():
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".cpp", ".h") and p.is_file()]
    assert len(sources) >= 5, f"csrc/: at least 5 .cu/.cuh/.cpp/.h files expected, got {len(sources)}"
