"""sample_rows: every row drawn under its own request's settings, however the batch mixes them."""

import torch

from kvlab.engine.sampling import SamplingParams, sample_rows
from kvlab.nn.sampling import draw, invert_cdf


def peaked(vocab: int, token: int) -> torch.Tensor:
    """Logits whose softmax puts all but ~e-40 of the mass on `token`."""
    row = torch.zeros(vocab)
    row[token] = 100.0
    return row


def test_each_row_keeps_its_own_token_and_rule():
    """Greedy, temperature-only, top_k and seeded rows interleaved: each row's draw is its own
    row's peak (a row read from the wrong place of the batched softmax would show another's)."""
    vocab = 50
    peaks = [3, 7, 11, 19, 23, 29]
    logits = torch.stack([peaked(vocab, t) for t in peaks])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.2, seed=4),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0)]
    generators = [torch.Generator().manual_seed(4) if p.seed is not None else None for p in params]
    got = sample_rows(logits, params, generators, torch.Generator().manual_seed(0))
    assert [s.token_id for s in got] == peaks


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    vocab = 64
    torch.manual_seed(1)
    logits = torch.randn(4, vocab)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=9),
              SamplingParams(temperature=0.5, top_k=10), SamplingParams(temperature=1.0)]

    def seeded_token(rows: list[int]) -> int:
        gens = [torch.Generator().manual_seed(9) if params[r].seed is not None else None for r in rows]
        out = sample_rows(logits[rows], [params[r] for r in rows], gens, torch.Generator().manual_seed(0))
        return out[rows.index(1)].token_id

    alone = seeded_token([1])
    assert seeded_token([0, 1, 2, 3]) == seeded_token([3, 2, 1]) == alone


def test_shared_rows_follow_their_distributions():
    """Rows on the engine's generator, drawn together: each row's empirical frequencies match its
    own softmax (two different temperatures over one set of logits)."""
    logits = torch.tensor([[0.0, 1.0, 2.0]] * 2)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.25)]
    default = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 3)
    for _ in range(3000):
        for row, s in enumerate(sample_rows(logits, params, [None, None], default)):
            counts[row, s.token_id] += 1
    for row, temperature in enumerate((1.0, 0.25)):
        expected = torch.softmax(logits[row] / temperature, -1)
        assert (counts[row] / 3000 - expected).abs().max() < 0.03


def test_the_inverse_cdf_never_draws_a_token_of_weight_zero():
    """u = 0 takes the first token of positive weight; u = 1 (rounding can put u x total at the
    total) the last, never the zero-weight tokens around them."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 5, dtype=torch.float64)
    cdf = weights.cumsum(-1)
    uniforms = torch.tensor([[0.0], [0.3], [0.4], [0.999999], [1.0]], dtype=torch.float64)
    assert invert_cdf(cdf, uniforms) == [1, 1, 3, 3, 3]


def test_draw_follows_the_weights_and_skips_cut_tokens():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0]])
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[draw(weights, generator)[0]] += 1
    assert counts[0] == counts[2] == 0
    assert abs(counts[3] / 4000 - 0.75) < 0.03
