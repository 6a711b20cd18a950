"""The real-models report's uptrained row: SmolLM2 mean-pooled to 1 KV head, then `kvlab uptrain`.

The table's 1-KV-head rows are conversions before any training, and they are not usable
models; mean pooling is where the GQA paper starts uptraining, not a deployment. This row is
the same conversion after distillation from the unconverted model (`kvlab uptrain`: KL on the
teacher's logits plus the LM loss) on *Pride and Prejudice*, the calibration novel, never the
evaluation one.

The run is the README's two commands, driven in slices so each report run stays inside its
--max-seconds:

    kvlab convert smollm2-135m --kv-heads 1 --method mean -o DIR
    kvlab uptrain DIR --teacher smollm2-135m --data pride-and-prejudice.txt --steps STEPS --stop-after N

DIR is outside the repository (the weights are about half a gigabyte): ~/.cache/kvlab/real-models,
or $KVLAB_REPORT_WORK. Each slice's `--json` report is kept beside it (uptrain.json) and
copied into the report folder by the caller: steps, tokens, and the held-out LM loss of the
conversion and of the uptrained model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from kvlab.evals.setting import KVSetting
from kvlab.files import write_json

STEPS, BATCH, BLOCK, SLICE = 160, 4, 128, 40  # 81,920 tokens; 28 min here (a step ~10 s), in slices of 7
# the row's recipe as it was run (kvlab uptrain's defaults then: every weight, KL and LM loss half and half,
# checkpoints every 50 steps); reports/conversions has the recipe that recovers the model
RECIPE = ["--train", "all", "--alpha", "0.5", "--lr", "3e-4", "--checkpoint-every", "50"]
TRAIN_TEXT = "pride-and-prejudice.txt"
SETTING = KVSetting("fp16", kv_heads=1, method="mean", uptrain_steps=STEPS)


def work_dir() -> Path:
    return Path(os.environ.get("KVLAB_REPORT_WORK", Path.home() / ".cache" / "kvlab" / "real-models"))


def model_dir() -> Path:
    return work_dir() / "smollm2-135m-kvh1-mean"


def last_report() -> Optional[dict]:
    """The last slice's `kvlab uptrain --json` report, or None before the first."""
    path = work_dir() / "uptrain.json"
    return json.loads(path.read_text()) if path.exists() else None


def finished() -> bool:
    report = last_report()
    return report is not None and report["finished"] and (model_dir() / "config.json").exists()


def run_slice(model: str, text: Path) -> dict:
    """Convert (once), then uptrain up to the next SLICE steps; returns that slice's report."""
    from kvlab.bench.cli_child import kvlab_cli

    work_dir().mkdir(parents=True, exist_ok=True)
    if not (model_dir() / "config.json").exists():
        convert = kvlab_cli(["convert", model, "--kv-heads", "1", "--method", "mean", "-o", str(model_dir()), "--force"],
                            timeout=None, progress=True)
        if convert.returncode != 0:
            raise SystemExit(f"real_models: kvlab convert {model} --kv-heads 1 failed")
    done = (last_report() or {}).get("steps", 0)
    slice_ = kvlab_cli(["uptrain", str(model_dir()), "--teacher", model, "--data", str(text), "--steps", str(STEPS),
                        "--batch-size", str(BATCH), "--block-size", str(BLOCK), *RECIPE,
                        "--stop-after", str(min(SLICE, STEPS - done)), "--json"], timeout=None, progress=True)
    if slice_.returncode != 0:
        raise SystemExit("real_models: kvlab uptrain failed")
    report = json.loads(slice_.stdout)  # its val_lm_loss_before is the conversion's: OUT changes only at the end
    write_json(work_dir() / "uptrain.json", report, indent=1)
    return report
