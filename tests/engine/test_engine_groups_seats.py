"""KIVI, KVQuant and pre-RoPE pools on a model with sliding layers (Gemma 3's shape) and under the sinks +
window policy: the engine serves them in one pool, the windowed groups hand back what left their window,
and greedy tokens equal the lab's own caches (every token held, the layers masking their window) decoding
each prompt alone, with requests joining mid-flight and preemption; the pool's bytes and start-up lines
are kvlab.plan.pool_capacity's, and the pool is free afterwards.
"""

import sys
from pathlib import Path

import pytest
import torch

from kvlab.cache.kv_groups import RELEASED
from kvlab.cache.kvquant import make_kvquant_cache
from kvlab.cache.kvquant_calibration import save_calibration
from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.engine.errors import RequestError
from kvlab.nn.generate import generate
from kvlab.plan.capacity import cache_formats, kv_fixed_bytes
from kvlab.plan.pool_capacity import engine_capacity, kivi_page_bytes, kvquant_page_bytes, seat_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_sliding_layers import tiny_model  # noqa: E402

WINDOW = 200  # wider than KIVI's full-precision residual of 128 + 32 tokens
BLOCK = 32  # a multiple of KIVI's group of 32 tokens
SEATS = 3
LENGTHS = [250, 40, 180]  # prompt lengths: the first slides its window before it decodes
NEW = 90


def gemma_like():
    return tiny_model(max_seq_len=512, sliding_window=WINDOW)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, 97, (n,), generator=generator).tolist() for n in LENGTHS]


def reference(model, ids: list[int], kv_cache_dtype: str, calibration=None, pre_rope: bool = False) -> list[int]:
    """The prompt alone through the lab's own cache of the format (every token held; the model's sliding
    layers mask what left their window)."""
    if calibration is not None:
        cache = make_kvquant_cache(kv_cache_dtype, calibration, 1, len(ids) + NEW, model.dtype, model.layer_ropes())
    else:
        cache = model.reference_cache(1, len(ids) + NEW, kv_cache_dtype, pre_rope=pre_rope)
    return generate(model, ids, NEW, cache=cache)[0].tolist()


def serve(eng: LLMEngine, work: list[list[int]]) -> tuple[list[list[int]], bool]:
    """The first prompt, then the others after 3 steps; each request's tokens, and whether a sliding group
    ever handed a block back."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ids = [eng.add_request(work[0], params).request_id]
    got, released, steps = {}, False, 0
    with torch.inference_mode():
        while eng.has_unfinished() or len(ids) < len(work):
            if steps == 3:
                ids += [eng.add_request(p, params).request_id for p in work[1:]]
            for delta in eng.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
            for seq, _ in eng.requests.values():
                released |= any(RELEASED in table for group, table in zip(eng.pool.groups, seq.block_tables)
                                if group.windowed)
            steps += 1
    return [got[i] for i in ids], released


def make(model, memory: int, **config) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(kv_cache_memory=memory, block_size=BLOCK, max_num_seqs=SEATS,
                                               max_num_batched_tokens=512, **config))


def assert_free(eng: LLMEngine) -> None:
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert all(block.ref_count == 0 for block in eng.blocks.blocks)
    assert sorted(eng.blocks.free_seats) == list(range(SEATS))


def fixed_and_seats(model, kv_cache_dtype: str) -> int:
    spec, formats = model.config.to_plan_spec(), cache_formats(kv_cache_dtype, model_dtype="fp32")
    return SEATS * seat_bytes(spec, formats, model.config.max_seq_len) + kv_fixed_bytes(spec, formats)


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    from kvlab.evals.calibrate import calibrate

    model = gemma_like()
    ids = torch.randint(1, 97, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    cal = calibrate(model, ids, context=128, windows=2, sensitivity=False)
    path = tmp_path_factory.mktemp("kvquant") / "tiny-gemma.kvquant.safetensors"
    save_calibration(cal, path)
    return cal, str(path)


@pytest.mark.parametrize("kv_cache_dtype", ["kivi4", "kivi2"])
def test_kivi_on_sliding_layers_equals_the_lab_cache(kv_cache_dtype):
    model = gemma_like()
    work = prompts()
    want = [reference(model, p, kv_cache_dtype) for p in work]
    eng = make(model, 3_000_000, kv_cache_dtype=kv_cache_dtype)
    assert [group.window for group in eng.pool.groups] == [WINDOW, WINDOW, None]
    got, released = serve(eng, work)
    assert got == want
    assert released  # the windows really slid and gave blocks back
    assert_free(eng)


def test_kivi_preempted_on_sliding_layers_keeps_the_outputs():
    """A pool too small for every request at once preempts (the sequence is computed again, its seat's ring
    and blocks rewritten), and the answers stay the lab's."""
    model = gemma_like()
    work = prompts()
    want = [reference(model, p, "kivi4") for p in work]
    spec, formats = model.config.to_plan_spec(), cache_formats("kivi4", model_dtype="fp32")
    block = kivi_page_bytes(spec.layers[0], formats, BLOCK)  # one layer per slot: three groups of one
    eng = make(model, 34 * block + fixed_and_seats(model, "kivi4"), kv_cache_dtype="kivi4")
    assert eng.blocks.num_blocks == 34
    got, _ = serve(eng, work)
    assert got == want
    assert eng.scheduler.num_preemptions > 0
    assert_free(eng)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_pre_rope_keys_on_sliding_layers_equal_the_lab_cache(kv_cache_dtype):
    model = gemma_like()
    work = prompts()
    want = [reference(model, p, kv_cache_dtype, pre_rope=True) for p in work]
    eng = make(model, 3_000_000, kv_cache_dtype=kv_cache_dtype, pre_rope_keys=True)
    assert eng.pool.pre_rope
    got, released = serve(eng, work)
    assert got == want
    assert released
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["kvquant4", "kvquant3"])
def test_kvquant_on_sliding_layers_equals_the_lab_cache(calibration_file, kv_cache_dtype):
    model = gemma_like()
    cal, path = calibration_file
    work = prompts()
    want = [reference(model, p, kv_cache_dtype, calibration=cal) for p in work]
    eng = make(model, 3_000_000, kv_cache_dtype=kv_cache_dtype, kv_calibration=path)
    assert eng.decode_path == "module by module"
    got, released = serve(eng, work)
    assert got == want
    assert released
    assert_free(eng)


def test_a_broken_kvquant_outlier_count_changes_the_output(calibration_file):
    """The running count of a sliding group's key outliers is what places the held rows' outliers: off by
    one, the keys read back differ and so does the text."""
    model = gemma_like()
    cal, path = calibration_file
    work = prompts()[:1]
    want = [reference(model, p, "kvquant4", calibration=cal) for p in work]
    eng = make(model, 3_000_000, kv_cache_dtype="kvquant4", kv_calibration=path)
    planes = eng.pool.kvquant
    store = planes.store

    def miscounted(layer, *args):
        store(layer, *args)
        planes.k_used[layer] += 1

    planes.store = miscounted
    got, _ = serve(eng, work)
    assert got != want


@pytest.mark.parametrize("kv_cache_dtype,page", [("kivi4", kivi_page_bytes), ("kvquant4", kvquant_page_bytes)])
def test_pool_bytes_and_start_up_lines_are_the_plans(calibration_file, kv_cache_dtype, page):
    model = gemma_like()
    memory = 2_000_000
    eng = make(model, memory, kv_cache_dtype=kv_cache_dtype, kv_calibration=calibration_file[1])
    spec, formats = model.config.to_plan_spec(), cache_formats(kv_cache_dtype, model_dtype="fp32")
    plan = engine_capacity(spec, memory, eng.max_model_len, formats, BLOCK, SEATS, 512)
    assert eng.capacity_lines == plan["log_lines"]
    assert [group["window"] for group in plan["kv_cache_groups"]] == [WINDOW, WINDOW, None]
    assert eng.blocks.num_blocks == plan["num_gpu_blocks"]
    assert eng.pool.nbytes() == plan["num_gpu_blocks"] * page(spec.layers[0], formats, BLOCK) + \
        fixed_and_seats(model, kv_cache_dtype)


def test_kvquant_with_sink_tokens_is_refused_in_one_line(calibration_file):
    with pytest.raises(RequestError, match="--sink-tokens is not supported"):
        make(gemma_like(), 2_000_000, kv_cache_dtype="kvquant4", kv_calibration=calibration_file[1], kv_window=64,
             sink_tokens=4)


# -- the sinks + window policy (--kv-window K --sink-tokens S) on a model of full layers ------------------------

class PolicyMasked:
    """A lab cache that holds every token, its layers masking what the sinks + window policy hides: a query at
    t sees p <= t when p is one of the first `sinks` or t - p <= window (kvlab.cache.window's rule)."""

    def __init__(self, cache, window: int, sinks: int) -> None:
        self.cache, self.window, self.sinks = cache, window, sinks

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def window_mask(self, layer: int, new: int) -> torch.Tensor:
        end = self.cache.seq_len(layer)
        queries, held = torch.arange(end - new, end)[:, None], torch.arange(end)[None, :]
        return (held <= queries) & ((held < self.sinks) | (held >= queries - self.window))


POLICY_WINDOW, POLICY_SINKS = 170, 4  # wider than KIVI's residual of 160 tokens


@pytest.mark.parametrize("kv_cache_dtype,sinks", [("kivi4", POLICY_SINKS), ("int4+prerope", POLICY_SINKS),
                                                  ("kvquant4", 0)])
def test_the_window_policy_equals_the_lab_cache_masked(stories_model, calibration_for_stories, kv_cache_dtype, sinks):
    model = stories_model
    dtype, pre_rope = kv_cache_dtype.split("+")[0], kv_cache_dtype.endswith("+prerope")
    cal, path = calibration_for_stories if dtype.startswith("kvquant") else (None, None)
    work = [list(range(1, 230)), list(range(300, 340)), list(range(50, 200))]

    def lab(ids: list[int]) -> list[int]:
        size = len(ids) + NEW
        cache = make_kvquant_cache(dtype, cal, 1, size, model.dtype, model.layer_ropes()) if cal is not None \
            else model.reference_cache(1, size, dtype, pre_rope=pre_rope)
        return generate(model, ids, NEW, cache=PolicyMasked(cache, POLICY_WINDOW, sinks))[0].tolist()

    want = [lab(p) for p in work]
    eng = make(model, 3_000_000, kv_cache_dtype=dtype, pre_rope_keys=pre_rope, kv_calibration=path,
               kv_window=POLICY_WINDOW, sink_tokens=sinks)
    assert [(group.window, group.sinks) for group in eng.pool.groups] == [(POLICY_WINDOW + 1, sinks)]
    spec = model.config.to_plan_spec().with_kv_window(POLICY_WINDOW, sinks)
    plan = engine_capacity(spec, 3_000_000, eng.max_model_len, cache_formats(dtype, model_dtype="fp32"), BLOCK,
                           SEATS if dtype.startswith(("kivi", "kvquant")) else 0, 512)
    assert eng.capacity_lines == plan["log_lines"]
    got, released = serve(eng, work)
    assert got == want
    assert released
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.fixture(scope="module")
def calibration_for_stories(stories_model, tmp_path_factory):
    from kvlab.evals.calibrate import calibrate

    ids = torch.randint(1, 500, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    cal = calibrate(stories_model, ids, context=128, windows=2, sensitivity=False)
    path = tmp_path_factory.mktemp("kvquant") / "stories.kvquant.safetensors"
    save_calibration(cal, path)
    return cal, str(path)


def test_a_kivi_window_narrower_than_the_residual_is_refused_in_one_line(stories_model):
    with pytest.raises(RequestError, match="narrower than kivi4's full-precision residual"):
        make(stories_model, 2_000_000, kv_cache_dtype="kivi4", kv_window=100)


@pytest.mark.parametrize("kv_cache_dtype", ["kivi4", "kivi2"])
def test_kivi_on_sliding_layers_in_c_equals_the_module_path(kv_cache_dtype):
    """The C step runs KIVI over the sliding groups (each row's window starting inside a key group, the
    released blocks skipped) as the module path does: the same greedy tokens, the pool free after."""
    from kvlab.nn.kernels import kernels
    from kvlab.nn.pack import pack_q8_0

    if kernels() is None:
        pytest.skip("no C kernels on this machine")
    model = pack_q8_0(tiny_model(max_seq_len=512, sliding_window=WINDOW, dim=64, head_dim=32, ffn_dim=96,
                                 embed_scale=8.0))
    work = prompts()
    module = make(model, 3_000_000, kv_cache_dtype=kv_cache_dtype, paged_step=False)
    fused = make(model, 3_000_000, kv_cache_dtype=kv_cache_dtype, paged_step=True)
    assert fused.decode_path == "fused C step" and module.decode_path == "module by module"
    want, _ = serve(module, work)
    got, released = serve(fused, work)
    assert got == want
    assert released
    assert_free(fused)
