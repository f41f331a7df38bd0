"""``import stable_attn``: what it registers and what it imports (each check in a fresh interpreter)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import stable_attn
from stable_attn import _version

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


def test_command_help_loads_neither_transformers_nor_lightning():
    out = _python(f"""
        import contextlib, io, sys
        sys.argv = ["stable-attn", "--help"]
        from stable_attn.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as text:
            try:
                main()
            except SystemExit as e:
                assert e.code == 0, e.code
        assert "report" in text.getvalue()
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert out.strip() == "[]"


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
