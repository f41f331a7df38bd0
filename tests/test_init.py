"""``import stable_attn``: what it registers and what it imports (each check in a fresh interpreter)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import stable_attn
import stable_attn_cli
from stable_attn import _version, cli
from stable_attn_cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent

# a sys.meta_path finder that makes transformers unimportable, as on a machine without it
BLOCK_TRANSFORMERS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
"""


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_registers_with_transformers_without_lightning():
    out = _python("""
        import sys
        import stable_attn
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
        from stable_attn.integrations import transformers as hf
        assert AttentionInterface()["stable_attn"] is hf.stable_attn_attention_forward
        assert AttentionMaskInterface()["stable_attn"] is hf.stable_attn_mask
        lightning = ("lightning", "pytorch_lightning", "lightning_fabric")
        print(sorted(m for m in sys.modules if m.split(".")[0] in lightning))
    """)
    assert out.strip() == "[]"


HEAVY = ("transformers", "lightning", "pytorch_lightning", "lightning_fabric", "triton", "torch._dynamo")


def test_import_loads_neither_transformers_nor_lightning_and_registers_when_transformers_loads():
    out = _python(f"""
        import sys
        import torch
        import stable_attn
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        from transformers import LlamaForCausalLM  # the model code loads: the registration happens then
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
        from stable_attn.integrations import transformers as hf
        for name in ("stable_attn", "stable-attn"):
            assert AttentionInterface()[name] is hf.stable_attn_attention_forward
            assert AttentionMaskInterface()[name] is hf.stable_attn_mask
        print(sum(type(f).__name__ == "_RegisterAfterLoad" for f in sys.meta_path))
    """)
    assert out.split("\n")[:2] == ["[]", "0"]


def test_import_after_transformers_registers_at_once():
    out = _python("""
        import sys
        import transformers.masking_utils
        import stable_attn
        from transformers.modeling_utils import AttentionInterface
        waiting = sum(type(f).__name__ == "_RegisterAfterLoad" for f in sys.meta_path)
        print("stable_attn" in AttentionInterface(), waiting)
    """)
    assert out.strip() == "True 0"


def test_importing_the_integration_first_registers_once_it_is_imported():
    """transformers then loads inside our integration's import: the integration registers at its end."""
    out = _python("""
        import sys
        import stable_attn
        from stable_attn.integrations.transformers import swap
        from transformers.modeling_utils import AttentionInterface
        from stable_attn.integrations.transformers import stable_attn_attention_forward as ours
        waiting = sum(type(f).__name__ == "_RegisterAfterLoad" for f in sys.meta_path)
        print(AttentionInterface()["stable-attn"] is ours, waiting)
    """)
    assert out.strip() == "True 0"


def test_console_script_is_the_torch_free_entry_point():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"stable-attn": "stable_attn_cli:main"}


@pytest.mark.parametrize("argv, code", [(["--help"], 0), ([], 2), (["no-such-command"], 2), (["--help", "report"], 0)])
def test_command_help_usage_and_errors_import_no_torch(argv, code):
    """``stable-attn --help``, ``stable-attn`` alone and an unknown command: the help or usage without torch."""
    out = _python(f"""
        import contextlib, io, sys
        from stable_attn_cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                code = main({argv!r})
            except SystemExit as e:
                code = e.code
        print(repr(out.getvalue() + err.getvalue()))
        print(code)
        print(sorted(m for m in ("torch", *{HEAVY!r}) if m in sys.modules))
    """)
    text, got, loaded = out.strip().split("\n")
    text = ast.literal_eval(text)
    assert (int(got), loaded) == (code, "[]"), text
    assert text.startswith("usage: stable-attn")
    if argv != ["no-such-command"]:
        assert all(f"{name} " in text and help_line.split()[0] in text for name, help_line in COMMANDS.items())
    else:
        assert "invalid choice: 'no-such-command'" in text


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_help_shows_its_arguments(name, capsys):
    with pytest.raises(SystemExit) as exc:
        stable_attn_cli.main([name, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    full = cli.build_parser()._subparsers._group_actions[0].choices[name]  # every command's arguments built
    assert text == full.format_help()
    assert {"report": "RUN_DIR", "probe": "--arithmetic", "replay": "BUNDLE_DIR"}[name] in text
    assert COMMANDS[name].split()[0] in text


def test_a_command_still_parses_and_refuses_its_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        stable_attn_cli.main(["replay"])
    assert exc.value.code == 2 and "BUNDLE_DIR" in capsys.readouterr().err
    assert stable_attn_cli.main(["replay", str(ROOT / "no-such-bundle")]) == 1
    assert capsys.readouterr().err.startswith("stable-attn replay: error:")


def test_attention_works_without_transformers():
    out = _python(BLOCK_TRANSFORMERS + """
import torch
import stable_attn
assert not any(m.split(".")[0] == "transformers" for m in sys.modules)
assert stable_attn.register() is False
q = torch.randn(1, 2, 5, 8)
st = stable_attn.AttentionStats()
out = stable_attn.attention(q, q, q, causal=True, stats=st)
want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
stable_attn.patch_sdpa()
stable_attn.unpatch_sdpa()
print(st.rows.tolist())
""")
    assert out.strip() == "[5, 5]"



def test_the_version_is_written_once_and_is_the_changelogs_next_heading():
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^dynamic = \[.*"version".*\]', project, re.M) and not re.search(r"^version\s*=", project, re.M)
    assert 'version = { attr = "stable_attn._version.__version__" }' in pyproject  # read without importing torch
    source = (ROOT / "stable_attn" / "_version.py").read_text()
    literal = [ast.literal_eval(n.value) for n in ast.parse(source).body if isinstance(n, ast.Assign)]
    assert literal == [_version.__version__] == [stable_attn.__version__]
    written = [p for p in (ROOT / "stable_attn").rglob("*.py") if "__version__ =" in p.read_text()]
    assert written == [ROOT / "stable_attn" / "_version.py"]
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == f"{stable_attn.__version__} (unreleased)"
