"""examples/train_layerwise.py in its quick mode: the rows, the table, the plot."""

import json

import pytest
from helpers import load_script  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.slow


def test_quick_run_writes_results_table_and_plot(tmp_path):
    example = load_script("examples/train_layerwise.py")
    out = example.main(["--quick", "--no-progress", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "layerwise_results.json").read_text())
    assert rows == out["rows"]
    configs = ("fp32", "fp16_dynamic", "fp16_headroom", "fp16_layerwise")
    assert sorted((r["config"], r["seed"]) for r in rows) == sorted(
        (c, s) for c in configs for s in range(2)
    )
    for r in rows:
        assert set(r) == {"config", "seed", "val_loss", "skipped_fraction", "lost_fraction"}
        assert 0 <= r["skipped_fraction"] <= 1 and 0 <= r["lost_fraction"] <= 1
        assert r["val_loss"] > 0
    table = (tmp_path / "layerwise_table.md").read_text()
    assert all(f"`{c}`" in table for c in configs)
    assert (tmp_path / "layerwise_scales.png").stat().st_size > 0
    assert "span:" in (tmp_path / "layerwise_diagnosis.txt").read_text()
    assert out["span"] > 5  # --quick: 4 layers (the default 10 span about 21 octaves)
