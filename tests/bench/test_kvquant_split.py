"""The K/V split study's cache: one half read back exactly as given, the other as the format rounds it."""

import pytest
import torch

from kvlab.cache.kvquant import make_kvquant_cache
from kvlab.cache.kvquant_calibration import KVQuantCalibration, fit_layer
from kvlab.bench.kvquant_split import key_outliers, with_exact

HEADS, DIM = 2, 16


def _cache():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(HEADS, 300, DIM, generator=g) * 3, torch.randn(HEADS, 300, DIM, generator=g)
    cal = KVQuantCalibration(HEADS, DIM, [fit_layer(k, v)], {})
    return make_kvquant_cache("kvquant3", cal, 1, 64, torch.float32, lambda x, positions: x)


def test_one_half_exact_the_other_as_the_format_rounds_it():
    g = torch.Generator().manual_seed(1)
    chunks = [(torch.randn(1, HEADS, n, DIM, generator=g) * 3, torch.randn(1, HEADS, n, DIM, generator=g))
              for n in (5, 1, 3)]
    plain, keys, values = _cache(), with_exact(_cache(), "keys"), with_exact(_cache(), "values")
    for k, v in chunks:
        rounded, with_keys, with_values = plain.update(0, k, v), keys.update(0, k, v), values.update(0, k, v)
    given_k, given_v = (torch.cat(half, 2) for half in zip(*chunks))
    assert not torch.equal(rounded[0], given_k) and not torch.equal(rounded[1], given_v)  # 3 bits do round
    assert torch.equal(with_keys[0], given_k) and torch.equal(with_keys[1], rounded[1])
    assert torch.equal(with_values[0], rounded[0]) and torch.equal(with_values[1], given_v)
    assert keys.nbytes() == plain.nbytes()  # it still stores (and counts) the format's rows
    pool = key_outliers([keys])
    outside = int((keys.k_rows[0].normalise(given_k[:, :, 1:]).abs() > 1).sum())  # past the fp16 sink token
    assert pool == {"key_values": HEADS * 8 * DIM, "outside_range": outside,
                    "kept_exact": int(keys.k_rows[0].counts.long().sum())}
    assert 0 < pool["kept_exact"] <= pool["outside_range"]
    rows = [2, 5]  # token positions 2 and 5: rows 1 and 4 past the sink token
    some = key_outliers([keys], rows)
    normalised = keys.k_rows[0].normalise(given_k[:, :, rows])
    assert some == {"key_values": HEADS * 2 * DIM, "outside_range": int((normalised.abs() > 1).sum()),
                    "kept_exact": int(keys.k_rows[0].counts.long()[:, :, [1, 4]].sum())}
    with pytest.raises(ValueError):
        with_exact(_cache(), "both")


def test_oracle_calibration_fits_the_evaluated_tokens_and_split_rows_labels_each_run(capsys) -> None:
    from needs import SHAKESPEARE, STORIES, require_file

    from kvlab.checkpoints.resolve import load_model
    from kvlab.bench.kvquant_split import oracle_calibration, split_rows

    require_file(STORIES, "stories260K")
    require_file(SHAKESPEARE, "tinyshakespeare")
    loaded = load_model(str(STORIES), torch.float32, "dense")
    model = loaded.model.eval()
    ids = loaded.tokenizer.encode(SHAKESPEARE.read_text()[:4000], add_bos=False)
    windows = [ids[:200], ids[200:400]]
    with pytest.raises(ValueError):
        oracle_calibration(model, [ids[:200], ids[:100]], {})
    oracle = oracle_calibration(model, windows, {"model": "stories260K"})
    assert oracle.meta["data"] == "the evaluated windows (oracle)" and oracle.meta["context"] == 200
    rows, pool = split_rows(model, windows, oracle, "kvquant3", 10.0, ", oracle")
    assert list(rows) == ["kvquant3, oracle", "kvquant3, oracle, exact keys", "kvquant3, oracle, exact values"]
    # the ranges are the evaluated keys' own 0.5-99.5 percentiles: about 1% of those keys fall outside
    assert 0.003 < pool["outside_range"] / pool["key_values"] < 0.02
    # it is the calibration of exactly those tokens, window by window, and of no others
    from kvlab.evals.calibrate import calibrate
    same, shifted = calibrate(model, ids[:400], context=200, windows=2), calibrate(model, ids[1:401], context=200,
                                                                                   windows=2)
    fitted = lambda cal: [t for layer in cal.layers for t in (layer.k_zero, layer.k_range, *layer.k_codebooks.values(),
                                                              *layer.v_codebooks.values())]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(fitted(oracle), fitted(same)))
    assert not all(torch.equal(a, b) for a, b in zip(fitted(oracle), fitted(shifted)))


def test_passkey_key_outliers_counts_the_prompt_and_its_key_tokens() -> None:
    from needs import STORIES, require_file

    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.calibrate import calibrate
    from kvlab.bench.kvquant_split import passkey_key_outliers

    require_file(STORIES, "stories260K")
    loaded = load_model(str(STORIES), torch.float32, "dense")
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    text = tokenizer.encode("Once upon a time there was a little girl who liked to play. " * 40, add_bos=False)
    cal = calibrate(model, text, context=100, windows=2)
    cell = passkey_key_outliers(model, tokenizer, cal, "kvquant4", 400, 0.5)
    every, key = cell["all_tokens"], cell["key_tokens"]
    layers, heads, dim = model.config.n_layers, model.config.kv_heads, model.config.head_size
    assert cell["depth"] == 0.5 and len(cell["key"]) == 5 and 350 <= cell["length"] <= 400
    assert every["key_values"] == layers * heads * (cell["length"] - 1) * dim
    spelled = key["key_values"] // (layers * heads * dim)  # the key's tokens, in both of its mentions
    assert key["key_values"] == spelled * layers * heads * dim and 2 <= spelled <= 12
    assert 0 < key["outside_range"] <= every["outside_range"] and key["kept_exact"] <= every["kept_exact"]
