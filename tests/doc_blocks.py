"""The code blocks of README and docs/, found, run as pasted and checked against what they say they print.

A block says what it prints with a comment on the printing line, `print(x)  # prints: <the line>`; every `print(`
in a block carries one, so a changed result fails the test instead of leaving a stale comment. Each block runs
alone, in a fresh namespace, in the test's temporary folder (blocks write `out`, `tiny-llama`, `lightning_logs`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PRINTS = re.compile(r"#\s*prints:\s*(.*?)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # the file's line the code starts on
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass
class Ran:
    scope: dict
    stdout: list[str]
    logs: list[str] = field(default_factory=list)


def blocks(path: Path, lang: str = "python") -> list[Block]:
    text = path.read_text()
    return [Block(path, text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(rf"```{lang}\n(.*?)```", text, flags=re.S)]


def text_blocks(path: Path, after: str) -> list[str]:
    """The ```text blocks of ``path`` after the first line that starts with ``after``."""
    text = path.read_text()
    return re.findall(r"```text\n(.*?)```", text[text.index(after):], flags=re.S)


def expected_prints(code: str) -> list[str]:
    """What the block's `# prints:` comments promise, in order; a print without one is an error."""
    want = []
    for n, line in enumerate(code.splitlines(), 1):
        if "print(" in line.split("#", 1)[0]:
            m = PRINTS.search(line)
            assert m, f"line {n} of the block prints without a '# prints:' comment: {line.strip()}"
            want.append(m.group(1))
    return want


def run(block: Block, tmp_path: Path, monkeypatch, caplog, capsys) -> Ran:
    """Run ``block`` as pasted in ``tmp_path``; check its `# prints:` comments against what it printed."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    scope: dict = {"__name__": "__doc_block__"}
    capsys.readouterr()
    try:
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            exec(compile(block.code, block.id, "exec"), scope)
    finally:
        torch.set_num_threads(threads)
    stdout = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    printed = iter(stdout)
    for want in expected_prints(block.code):
        assert any(line == want for line in printed), f"{block.id} does not print {want!r} (printed: {stdout})"
    return Ran(scope, stdout, [r.getMessage() for r in caplog.records if r.name.startswith("stable_attn")])


def quoted_lines(text_block: str) -> list[str]:
    """The lines of a quoted output block, each as the prefix it promises (a trailing `...` cuts it)."""
    return [line.removesuffix("...").rstrip() for line in text_block.strip().splitlines()]


NUMBER = re.compile(r"(-?\d+(?:\.\d+)?)")


def same_line(quoted: str, real: str, rel: float = 0.02) -> bool:
    """``real`` starts like ``quoted``: the same words and integers, every decimal within ``rel`` of the quoted one
    (another CPU's summation order moves the last digits of a loss)."""
    want, got = NUMBER.split(quoted), NUMBER.split(real)
    if len(got) < len(want):
        return False
    for i, (w, g) in enumerate(zip(want, got)):
        if i % 2 == 0:  # text between numbers; the last quoted piece only starts the real one
            if (w != g) if i < len(want) - 1 else not g.startswith(w):
                return False
        elif "." not in w and w != g:  # steps, counts, indices: exact
            return False
        elif abs(float(w) - float(g)) > rel * max(abs(float(w)), abs(float(g))):
            return False
    return True
