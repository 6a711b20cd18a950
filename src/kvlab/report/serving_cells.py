"""Reading `kvlab bench compare`'s result JSON for the serving report: a peer's run in a cell, whether its answers
came back whole, and where a result was measured. serving_report.py and serving_target.py both read cells this way.
"""

from __future__ import annotations

from typing import Optional

# A peer's latencies are held against kvlab's only where it sent back at least this share of the tokens asked:
# llama.cpp's default server cancels the streaming request when the next arrives, and its TPOT is then
# timed over the few tokens each request got before it was cut off, not over an answer.
DELIVERED = 0.9


def provenance_text(result: dict) -> str:
    """Where a result was measured: its commit (and files edited), time and machine."""
    prov = result["provenance"]
    commit = (prov.get("git_commit") or "unknown")[:7]
    dirty = prov.get("git_dirty_files") or []
    edited = f" with {', '.join(dirty)} edited" if dirty else ""
    return (f"commit {commit}{edited}, {prov['time_utc']}, {prov['machine']['cpu']} ({prov['machine']['cores']} "
            f"cores, {prov['machine']['torch_threads']} threads)")


def run_of(peer: dict, cell: dict) -> Optional[dict]:
    """The peer's run for a cell (prompt length and concurrency), or None if it has none."""
    return next((r for r in peer.get("runs", []) if r.get("input_len") == cell["input_len"]
                 and r["max_concurrency"] == cell["max_concurrency"]), None)


def delivered(run: dict) -> bool:
    """Whether a run sent back DELIVERED of the tokens asked: only then are its latencies an answer's."""
    return run["total_output_tokens"] >= DELIVERED * run["requested_output_tokens"]
