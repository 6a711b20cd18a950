"""Merge groups of KV heads into one each, aligned on calibration activations (not averaged).

Mean-pooling K/V heads (Ainslie et al., 2023) adds heads that live in unrelated bases: on
SmolLM2-135M, 3 -> 1 KV head by the mean costs 550x in perplexity. Heads of one group compute
similar things in rotated coordinates, so the merge first aligns them (arXiv 2412.20677,
fpcsong/mha2gqa: an orthogonal map per head fitted by Procrustes; for keys one that commutes
with RoPE). Both halves here are the least-squares optimum of that idea on the activations
x of a calibration text, summarised by their second moment sigma = E[x x^T]:

- Keys, per RoPE frequency f (kvlab.checkpoints.rope_pairs): the pair-f components of the
  group's keys form a complex vector [k_1f .. k_mf]. The merged key's pair f is its best
  rank-1 summary: the top eigenvector v of its covariance, each head weighted by the energy
  of the queries that read it (score error = query x key error). Head g's key is then
  approximately c_g k*_f with a complex c_g, a per-head 2x2 rotation with a scale, which
  commutes with RoPE and moves into that head's queries: q_hf <- conj(c_g) q_hf. This is the
  Procrustes rotation per frequency pair per head, with the mixing weights and the scale
  fitted too (a complex PCA across heads; TransMLA's RoRoPE mixes heads with real weights).
  Norms restored: the summary keeps a fraction of the key energy at each frequency, and the
  queries of that frequency are scaled up by 1 / sqrt(that fraction), so the scores keep
  their spread (without it attention flattens).
- Values: any invertible map of the merged value is absorbed by the output projection, so
  the merged value is the best d-dimensional summary of the group's values, measured by what
  reaches the residual stream: each head's value is weighted by M_g = sum of W_o_h^T W_o_h
  over the query heads that read it, and the summary is the top-d principal subspace of the
  weighted values (an orthogonal alignment of the heads is one point of that search). The
  output projection of each head then maps the summary back to its head's value; the caller
  (kvlab.checkpoints.layerwise) refits it on the attention outputs actually produced.

With one head per group every step is the identity. When the heads of a group are RoPE-
commuting rotations of one another (keys) and orthogonal maps of one another (values), the
merge is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import torch

from kvlab.checkpoints.rope_pairs import pair_energy, psd_power, to_complex, to_real


@dataclass(frozen=True)
class MergedLayer:
    """One layer's new projections (float64) and how much of the weighted energy the merge kept."""

    wq: torch.Tensor  # [H, d, in], query heads in the new order
    wk: torch.Tensor  # [N, d, in]
    wv: torch.Tensor  # [N, d, in]
    wo: torch.Tensor  # [out, H, d], columns in the new order
    key_kept: float
    value_kept: float


def merge_keys(wq: torch.Tensor, wk: torch.Tensor, sigma: torch.Tensor, rep: int, group: Sequence[int],
               style: str, restore: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The group's merged key rows [d, in], its query heads' new rows [len(group) * rep, d, in]
    (heads of group[0] first), and the weighted key energy kept (a fraction)."""
    qc = to_complex(wq, style)  # [H, d/2, in]
    kc = to_complex(wk[list(group)], style)  # [m, d/2, in]
    query_energy = pair_energy(qc, sigma)  # [H, d/2]
    reading = torch.stack([query_energy[g * rep:(g + 1) * rep].sum(0) for g in group])  # [m, d/2]
    weight = reading.clamp_min(torch.finfo(reading.dtype).tiny).sqrt()
    z = kc * weight[..., None]  # weighted key rows
    sigma_c = sigma.to(z.dtype)
    cov = torch.einsum("gfa,ab,hfb->fgh", z, sigma_c, z.conj())  # [d/2, m, m], E[z_g conj(z_h)]
    values, vectors = torch.linalg.eigh(cov)
    top = vectors[..., -1]  # [d/2, m]
    total = values.sum(-1).clamp_min(torch.finfo(values.dtype).tiny)
    kept = (values[..., -1] / total).clamp(min=1e-6, max=1.0)
    coeff = top / weight.T  # key_g ~ coeff[:, g] * merged
    ref = int(reading.sum(1).argmax())  # the merged key is expressed in the most-read head's frame
    anchor = coeff[:, ref].clone()
    anchor = torch.where(anchor.abs() > 0, anchor, torch.ones_like(anchor))
    merged = anchor[:, None] * torch.einsum("fg,gfa->fa", top.conj(), z)  # [d/2, in]
    coeff = coeff / anchor[:, None]
    scale = kept.rsqrt() if restore else torch.ones_like(kept)
    queries = [coeff[:, j, None].conj() * scale[:, None] * qc[g * rep + r]
               for j, g in enumerate(group) for r in range(rep)]
    energy = float((values[..., -1]).sum() / total.sum())
    return to_real(merged, style), to_real(torch.stack(queries), style), energy


def merge_values(wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor, rep: int,
                 group: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The merged value rows [d, in], each query head's new output columns [out, m * rep, d]
    (heads of group[0] first), and the weighted value energy kept."""
    d = wv.shape[1]
    m = len(group)
    metrics = [sum(wo[:, h].T @ wo[:, h] for h in range(g * rep, (g + 1) * rep)) for g in group]
    roots = [psd_power(metric, 0.5) for metric in metrics]
    inverse_roots = [psd_power(metric, -0.5) for metric in metrics]
    z = torch.cat([root @ wv[g] for root, g in zip(roots, group)])  # [m d, in], weighted values
    cov = z @ sigma @ z.T
    values, vectors = torch.linalg.eigh(cov)
    basis = vectors[:, -d:]  # [m d, d]
    summary = basis.T @ z  # [d, in]
    ref = max(range(m), key=lambda j: float(metrics[j].trace()))
    # express the summary in the frame of the head that matters most: the regression of its
    # value on the summary (the identity when the group is one head)
    cross = wv[group[ref]] @ sigma @ summary.T
    gram = summary @ sigma @ summary.T
    frame = cross @ torch.linalg.pinv(gram, hermitian=True)
    merged = frame @ summary
    back = torch.linalg.pinv(frame)
    columns = [wo[:, g * rep + r] @ inverse_roots[j] @ basis[j * d:(j + 1) * d] @ back
               for j, g in enumerate(group) for r in range(rep)]
    energy = float(values[-d:].sum() / values.sum().clamp_min(torch.finfo(values.dtype).tiny))
    return merged, torch.stack(columns, dim=1), energy


def merge_layer(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor,
                groups: Sequence[Sequence[int]], style: str, restore: bool = True) -> MergedLayer:
    """All groups of one layer (projections as [heads, d, in] and wo as [out, H, d], float64)."""
    rep = wq.shape[0] // wk.shape[0]
    new_q, new_k, new_v, new_o, key_kept, value_kept = [], [], [], [], [], []
    for group in groups:
        key, queries, kept_k = merge_keys(wq, wk, sigma, rep, group, style, restore)
        value, columns, kept_v = merge_values(wv, wo, sigma, rep, group)
        new_q.append(queries)
        new_k.append(key)
        new_v.append(value)
        new_o.append(columns)
        key_kept.append(kept_k)
        value_kept.append(kept_v)
    return MergedLayer(torch.cat(new_q), torch.stack(new_k), torch.stack(new_v), torch.cat(new_o, dim=1),
                       sum(key_kept) / len(groups), sum(value_kept) / len(groups))


def group_score(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor,
                group: Sequence[int], style: str) -> float:
    """How much weighted key and value energy merging `group` keeps (higher is better)."""
    rep = wq.shape[0] // wk.shape[0]
    return merge_keys(wq, wk, sigma, rep, group, style)[2] + merge_values(wv, wo, sigma, rep, group)[2]


def choose_groups(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor,
                  kv_heads: int, style: str) -> list[list[int]]:
    """Which source KV heads share a merged head: the partition into `kv_heads` equal groups that keeps
    the most energy, searched exhaustively for up to 8 heads and greedily (best group of the heads
    left, repeatedly) beyond. With one group, or groups of one, there is no choice."""
    heads = list(range(wk.shape[0]))
    size = len(heads) // kv_heads
    if kv_heads == 1 or size == 1:
        return [heads[i:i + size] for i in range(0, len(heads), size)]
    cache: dict[tuple[int, ...], float] = {}

    def score(group: tuple[int, ...]) -> float:
        if group not in cache:
            cache[group] = group_score(wq, wk, wv, wo, sigma, group, style)
        return cache[group]

    if len(heads) <= 8:
        best, best_score = None, float("-inf")
        for partition in _partitions(tuple(heads), size):
            total = sum(score(g) for g in partition)
            if total > best_score:
                best, best_score = partition, total
        return [list(g) for g in best]
    left, chosen = heads, []
    while left:
        group = max(combinations(left, size), key=score)
        chosen.append(list(group))
        left = [h for h in left if h not in group]
    return chosen


def _partitions(heads: tuple[int, ...], size: int):
    """Every split of `heads` into groups of `size`, each group listed once (its first head fixed)."""
    if not heads:
        yield []
        return
    first, rest = heads[0], heads[1:]
    for others in combinations(rest, size - 1):
        group = (first, *others)
        remaining = tuple(h for h in rest if h not in others)
        for tail in _partitions(remaining, size):
            yield [group, *tail]
