#!/usr/bin/env python3
"""Regenerate (or check) every command output shown in README.md.

    python3 scripts/readme_outputs.py           # run each `$ kvlab ...` in a ```text block, rewrite its output
    python3 scripts/readme_outputs.py --check   # exit 1 if any shown output is stale (timings aside)
    python3 scripts/readme_outputs.py --check --skip-slow   # ... except the benchmarks (the test suite's check)
    python3 scripts/readme_outputs.py --only "kvlab bench throughput"   # just the commands that start so

A README block that shows a command's output is a ```text fence whose lines starting with
"$ " are commands; the lines after each, up to the next command (a blank line between), are
what it printed (stdout and stderr, in order). Pasted outputs go stale as the code changes;
this script makes them the code's. `--check` compares with timings masked (tokens/s, ms,
GB/s, the bandwidth's timestamp), since those differ on every run: everything else, figures,
texts and tokens, must be what the current code prints. tests/test_readme_outputs.py runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```text\n(.*?)^```$", re.S | re.M)
BOX = re.compile(r"[│┃┏━┳┓┡╇┩└┴┘─┬┼├┤┌┐]+")
NUMBER = r"\d[\d,]*(?:\.\d+)?"
# a number followed by a unit of time or speed, anywhere
TIMED = re.compile(rf"{NUMBER}(?=\s*(?:ms\b|s\b|tok/s|tokens/s|GB/s|%))")
# table rows whose every number is a timing, or depends on this machine's bandwidth
TIMED_ROWS = ("prefill tokens/s", "decode tokens/s", "fraction of bandwidth roofline", "bandwidth GB/s",
              "Throughput:", "Engine one request", "Ratios:", "requests:", "llama.cpp batched")
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
SOURCE = re.compile(r"^\(?/\S*bandwidth\.json\)*$")  # the bandwidth file's path, when rich wraps it alone


def blocks(text: str) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """(start, end, [(command, output)]) for each ```text fence that holds `$ ` commands."""
    found = []
    for match in FENCE.finditer(text):
        pairs: list[tuple[str, list[str]]] = []
        for line in match.group(1).splitlines():
            if line.startswith("$ "):
                pairs.append((line[2:], []))
            elif pairs:
                pairs[-1][1].append(line)
        if pairs:
            found.append((match.start(1), match.end(1), [(cmd, "\n".join(out).strip("\n")) for cmd, out in pairs]))
    return found


ANY_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# a command shown as `flock LOCK kvlab ...` (a heavy run under the shared lock) is the kvlab command it runs
COMMAND = re.compile(r"^(?:\$ )?(?:flock \S+ )?((?:[A-Z_]+=\S+ )*kvlab \S.*)$")


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """(fence language, [command]) for each fence of README.md showing `kvlab ...` commands, in order.

    Every fence counts (```bash, ```console, ```text), with or without a `$ ` prompt or a `flock LOCK`
    prefix; a trailing
    `# comment` is dropped, a line ending in a backslash goes on on the next, `a; b` is two
    commands, leading VAR=value assignments stay. tests/test_readme_commands.py runs them.
    """
    found = []
    for match in ANY_FENCE.finditer(text):
        commands = []
        for line in re.sub(r"\\\n\s*", " ", match.group(2)).splitlines():  # `\` continues a line
            shown = COMMAND.match(line.strip())
            if shown:
                words = shlex.split(shown.group(1), comments=True)
                while ";" in "".join(words):  # `kvlab a; kvlab b`: two commands on one line
                    cut = next(i for i, w in enumerate(words) if w.endswith(";"))
                    commands.append(shlex.join(words[:cut] + [words[cut][:-1]]))
                    words = words[cut + 1:]
                commands.append(shlex.join(words))
        if commands:
            found.append((match.group(1), commands))
    return found


def run(command: str) -> str:
    """What `command` prints on a terminal-less run, stdout and stderr interleaved as written."""
    argv = shlex.split(command)
    if argv[0] == "kvlab":
        argv = [sys.executable, "-m", "kvlab.cli", *argv[1:]]
    elif argv[0] == "python3" and argv[1].startswith("scripts/"):
        argv = [sys.executable, *argv[1:]]
    else:
        raise SystemExit(f"readme_outputs: only kvlab commands and python3 scripts/... are run, not {command!r}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "TERM": "dumb"}
    done = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"readme_outputs: `{command}` exited {done.returncode}:\n{done.stdout}")
    return "\n".join(line.rstrip() for line in done.stdout.strip("\n").splitlines())


def masked(output: str) -> list[str]:
    """The output as comparable words: box drawing, spacing and wrapping dropped, timings as '#'.

    Rows of timed quantities keep only their label; the bandwidth's source ("measured now" or
    the file it was read from, which rich may wrap onto a second line) is a property of the
    machine, not of the code, so it is dropped too.
    """
    words = []
    for line in output.splitlines():
        flat = " ".join(BOX.sub(" ", line).split())
        label = next((row for row in TIMED_ROWS if flat.startswith(row)), None)
        flat = label if label else TIMED.sub("#", STAMP.sub("#", flat))
        words += [w for w in flat.split() if not SOURCE.match(w)]
    return words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 when stale")
    parser.add_argument("--skip-slow", action="store_true",
                        help="leave benchmark blocks (`kvlab bench ...`, minutes each) as they are")
    parser.add_argument("--only", metavar="PREFIX",
                        help="run only the commands that start with PREFIX, leaving the rest as they are "
                             "(one benchmark re-measured without minutes of the others)")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    stale, pieces, at = [], [], 0
    for start, end, pairs in blocks(text):
        shown = []
        for command, old in pairs:
            if (args.skip_slow and command.startswith("kvlab bench")) or \
                    (args.only and not command.startswith(args.only)):
                shown.append(f"$ {command}\n{old}")
                continue
            new = run(command)
            if masked(new) != masked(old):
                stale.append((command, old, new))
            shown.append(f"$ {command}\n{new if not args.check else old}")
        pieces += [text[at:start], "\n\n".join(shown) + "\n"]
        at = end
    pieces.append(text[at:])
    if args.check:
        for command, old, new in stale:
            print(f"stale README output for `{command}`:\n--- shown\n{old}\n--- now\n{new}\n")
        return 1 if stale else 0
    README.write_text("".join(pieces), encoding="utf-8")
    print(f"readme_outputs: {sum(len(p) for _, _, p in blocks(text))} outputs regenerated in {README.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
