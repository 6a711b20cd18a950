"""`kvlab study gqa`: train MHA, GQA, MQA and MLA character models; measure quality, cache
bytes and decode speed; uptrain the MHA model into GQA/MQA by mean-pool, first-head and random.

Every stage leaves its result in the work folder (a checkpoint per run, a JSON per stage), so
a killed study rerun with the same settings resumes where it stopped, and a partial
results.json is rewritten after each stage. The folder's name carries a hash of the preset
and the data, so changed settings never resume from stale runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvlab.checkpoints.convert import WEIGHT_METHODS, convert_kv_heads
from kvlab.nn.model import Decoder
from kvlab.studies import gqa_measure as measure
from kvlab.bench.provenance import git_commit, git_state, load_average, provenance
from kvlab.studies.gqa_config import Preset, Variant, fingerprint, train_config, uptrain_config, variants
from kvlab.files import read_json, write_json
from kvlab.train.data import CharCorpus, cache_dir, eval_batches, load_corpus
from kvlab.train.loop import Trainer, mean_loss, validation_loss

Log = Callable[[str], None]
BYTE_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)


def stderr_log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class StudyOptions:
    preset: Preset
    seeds: tuple[int, ...] = (0, 1)
    data: Optional[str] = None
    out: Optional[Path] = None  # report folder (results.json, README.md, figures)
    work: Optional[Path] = None  # checkpoints and stage results (default: ~/.cache/kvlab/studies)
    progress: bool = True
    log: Optional[Log] = stderr_log
    command: str = "kvlab study gqa"
    report: bool = True


class GqaStudy:
    def __init__(self, options: StudyOptions, corpus: CharCorpus):
        self.options, self.corpus, self.preset = options, corpus, options.preset
        root = Path(options.work) if options.work is not None else cache_dir() / "studies"
        self.work = root / f"gqa-{self.preset.name}-{fingerprint(self.preset, corpus.sha256)}"
        self.out = Path(options.out) if options.out is not None else self.work / "report"
        self.variants = variants(self.preset, corpus.vocab_size)
        self.started = time.time()
        self.load_start = load_average()
        self.git = git_state()  # the code this process imported, not what the tree holds later

    def log(self, message: str) -> None:
        if self.options.log is not None:
            self.options.log(message)

    # -- stages -----------------------------------------------------------------------------------

    def run(self) -> dict:
        threads = torch.get_num_threads()
        if self.preset.threads:
            torch.set_num_threads(self.preset.threads)
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)

    def _run(self) -> dict:
        self.log(f"study gqa ({self.preset.name}): work folder {self.work}, report to {self.out}, "
                 f"{torch.get_num_threads()} torch thread(s)")
        runs = []
        for seed in self.options.seeds:
            for variant in self.variants:
                runs.append(self.train_run(variant, seed))
                self.write_partial(runs)
        speed = self.cached("decode.json", self.measure_decode)
        self.write_partial(runs, speed)
        cache_bytes = self.cached("cache_bytes.json", self.measure_prefill_bytes)
        uptraining = [self.uptrain(method, kv) for kv in self.uptrain_targets() for method in WEIGHT_METHODS]
        control = self.uptrain("none", self.preset.n_heads)
        results = self.assemble(runs, speed, cache_bytes, uptraining, control, complete=True)
        self.finish(results)
        return results

    def train_run(self, variant: Variant, seed: int) -> dict:
        folder = self.work / "runs" / f"{variant.name}-s{seed}"
        done = read_json(folder / "result.json")
        if done is not None:
            self.log(f"{variant.name} seed {seed}: done earlier, val loss {done['val_loss']:.4f}")
            return done
        start = time.time()
        torch.manual_seed(seed)
        model = Decoder(variant.config)
        config = train_config(self.preset, seed)
        trainer = Trainer(model, self.corpus, config, folder / "checkpoint.pt", progress=self.options.progress,
                          label=f"{variant.name} s{seed}", log=self.options.log)
        if trainer.state.step:
            self.log(f"{variant.name} seed {seed}: resuming at step {trainer.state.step}")
        state = trainer.fit()
        val = validation_loss(model, self.corpus, self.preset.block_size, max_tokens=self.preset.val_tokens)
        result = {
            "variant": variant.name, "kv_heads": variant.kv_heads, "seed": seed, "params": variant.config.param_count(),
            "steps": state.step, "val_loss": val, "train_tokens_per_s": state.tokens_per_s,
            "train_seconds": state.train_seconds, "wall_seconds": time.time() - start, "history": state.history,
            "sample": measure.sample_text(model, self.corpus, self.preset.sample_chars, seed),
        }
        write_json(folder / "result.json", result)
        self.log(f"{variant.name} seed {seed}: val loss {val:.4f}, {state.tokens_per_s:,.0f} train tok/s")
        return result

    def load_trained(self, variant: Variant, seed: int) -> Decoder:
        saved = torch.load(self.work / "runs" / f"{variant.name}-s{seed}" / "checkpoint.pt", map_location="cpu",
                           weights_only=False)
        model = Decoder(variant.config)
        model.load_state_dict(saved["model"])
        return model.eval()

    def measure_decode(self) -> dict:
        start = time.time()
        speed = self._measure_decode()
        write_json(self.work / "decode_seconds.json", {"seconds": time.time() - start})
        return speed

    def _measure_decode(self) -> dict:
        seed = self.options.seeds[0]
        models = {v.name: self.load_trained(v, seed) for v in self.variants}
        self.log(f"decode: {self.preset.decode_tokens} tokens at batch {list(self.preset.decode_batches)}, "
                 f"{self.preset.decode_repeats} interleaved repeats, seed-{seed} weights")
        return measure.decode_speed(models, self.preset.decode_batches, self.preset.decode_tokens,
                                    self.preset.decode_repeats, measure.prompt_id(self.corpus), self.options.log,
                                    self.options.progress)

    def measure_prefill_bytes(self) -> dict:
        seed, first = self.options.seeds[0], measure.prompt_id(self.corpus)
        return {v.name: measure.prefill_bytes(self.load_trained(v, seed), BYTE_CONTEXTS, first)
                for v in self.variants}

    def uptrain_targets(self) -> list[int]:
        return [kv for kv in self.preset.kv_heads if kv != self.preset.n_heads]

    def uptrain(self, method: str, kv_heads: int) -> dict:
        """Convert the MHA model (first seed) to `kv_heads` by `method`, then fine-tune 5% of the steps.

        method "none" is the control: MHA itself fine-tuned the same way, so the uptrained
        models' extra steps are not mistaken for a benefit of fewer heads.
        """
        seed = self.options.seeds[0]
        name = "control" if method == "none" else f"{method}-kv{kv_heads}"
        folder = self.work / "uptrain" / name
        done = read_json(folder / "result.json")
        if done is not None:
            return done
        start = time.time()
        mha = next(v for v in self.variants if v.kv_heads == self.preset.n_heads)
        source = self.load_trained(mha, seed)
        model = source if method == "none" else convert_kv_heads(source, kv_heads, method, seed=seed)
        config = uptrain_config(self.preset, seed)
        before = validation_loss(model, self.corpus, self.preset.block_size, max_tokens=self.preset.val_tokens)
        first_point = mean_loss(model, eval_batches(self.corpus.val, config.eval_batches, config.batch_size,
                                                    config.block_size))
        trainer = Trainer(model, self.corpus, config, folder / "checkpoint.pt", progress=self.options.progress,
                          label=f"uptrain {name}", log=self.options.log)
        state = trainer.fit()
        after = validation_loss(model, self.corpus, self.preset.block_size, max_tokens=self.preset.val_tokens)
        result = {
            "method": method, "kv_heads": kv_heads, "source": f"{mha.name} seed {seed}", "steps": state.step,
            "val_loss_before": before, "val_loss_after": after,
            "curve": [{"step": 0, "val_loss": first_point}] + [{"step": h["step"], "val_loss": h["val_loss"]}
                                                               for h in state.history],
            "train_seconds": state.train_seconds, "wall_seconds": time.time() - start,
        }
        write_json(folder / "result.json", result)
        self.log(f"uptrain {name}: val loss {before:.4f} -> {after:.4f} after {state.step} steps")
        return result

    def cached(self, file_name: str, compute: Callable[[], dict]) -> dict:
        done = read_json(self.work / file_name)
        if done is None:
            done = compute()
            write_json(self.work / file_name, done)
        return done

    # -- results ----------------------------------------------------------------------------------

    def assemble(self, runs, speed=None, cache_bytes=None, uptraining=(), control=None, complete=False) -> dict:
        return {
            "study": "gqa", "complete": complete, "command": self.options.command,
            "preset": asdict(self.preset), "seeds": list(self.options.seeds),
            "provenance": self.provenance(),
            "variants": [self.describe(v) for v in self.variants],
            "summary": summarise(runs),
            "runs": [run_record(run) for run in runs],
            "decode": speed, "cache_bytes_prefill": cache_bytes,
            "uptraining": list(uptraining), "uptrain_control": control,
        }

    def describe(self, variant: Variant) -> dict:
        config = variant.config
        return {"variant": variant.name, "kv_heads": variant.kv_heads, "attention": config.attention,
                "params": config.param_count(), "cached_elements_per_token_per_layer":
                variant.cached_per_token_per_layer,
                "kv_bytes_per_token": _bytes_per_token(variant), "config": config.to_dict()}

    def provenance(self) -> dict:
        invocations = read_json(self.work / "invocations.json") or []
        now = time.time() - self.started
        return {
            **provenance(git=self.git),
            "data": {"source": self.corpus.source, "sha256": self.corpus.sha256, "vocab_size": self.corpus.vocab_size,
                     "train_tokens": len(self.corpus.train), "val_tokens": len(self.corpus.val)},
            "seeds": list(self.options.seeds), "work_folder": str(self.work), "report_folder": str(self.out),
            "wall_seconds": now, "wall_seconds_all_invocations": now + sum(i["seconds"] for i in invocations),
            "earlier_invocations": invocations, "stage_seconds": self.stage_seconds(),
            "load_average_start": self.load_start,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
        }

    def stage_seconds(self) -> dict:
        """Wall seconds each stage took, from the stage results on disk (whichever invocation ran them)."""
        runs = [read_json(p) for p in sorted((self.work / "runs").glob("*/result.json"))]
        uptrain = [read_json(p) for p in sorted((self.work / "uptrain").glob("*/result.json"))]
        return {"training": sum(r["wall_seconds"] for r in runs), "uptraining": sum(r["wall_seconds"] for r in uptrain),
                "decode": (read_json(self.work / "decode_seconds.json") or {}).get("seconds")}

    def write_partial(self, runs, speed=None) -> None:
        write_json(self.out / "results.json", self.assemble(runs, speed))

    def finish(self, results: dict) -> None:
        write_json(self.out / "results.json", results)
        if self.options.report:
            from kvlab.nn.config import plan_spec
            from kvlab.report.gqa_report import write_report

            write_report(results, self.out, plan_spec)
        invocations = read_json(self.work / "invocations.json") or []
        invocations.append({"started": results["provenance"]["started"], "seconds": time.time() - self.started,
                            "load_average_start": self.load_start, "load_average_end": load_average(),
                            "git_commit": git_commit(self.git)})
        write_json(self.work / "invocations.json", invocations)
        self.log(f"study gqa: wrote {self.out / 'results.json'}")


def _bytes_per_token(variant: Variant) -> int:
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token

    return int(kv_bytes_per_token(variant.config.to_plan_spec(), cache_formats("auto", model_dtype="fp32")))


def run_record(run: dict) -> dict:
    """One trained model's record: what its own run measured, nothing more.

    Decode speed and cache bytes are measured once per variant (on seed 0's weights) and live
    in the results' "decode" section; copying them into every seed's record would count one
    measurement as several.
    """
    keys = ("variant", "kv_heads", "seed", "params", "steps", "val_loss", "train_tokens_per_s", "train_seconds",
            "wall_seconds", "sample", "history")
    return {key: run[key] for key in keys}


def summarise(runs: list[dict]) -> dict:
    """Per variant: validation loss mean, sample standard deviation and range over seeds."""
    out: dict[str, dict] = {}
    for run in runs:
        out.setdefault(run["variant"], {"kv_heads": run["kv_heads"], "losses": [], "tok_s": []})
        out[run["variant"]]["losses"].append(run["val_loss"])
        out[run["variant"]]["tok_s"].append(run["train_tokens_per_s"])
    summary = {}
    for name, item in out.items():
        losses = item["losses"]
        summary[name] = {
            "kv_heads": item["kv_heads"], "seeds": len(losses), "val_loss_mean": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "val_loss_min": min(losses), "val_loss_max": max(losses),
            "train_tokens_per_s_mean": statistics.fmean(item["tok_s"]),
        }
    return summary


def run_study(options: StudyOptions) -> dict:
    corpus = load_corpus(options.data)
    return GqaStudy(options, corpus).run()
