"""Imports from the checkout's root: its ``kernels/`` and ``passes/`` folders shadow nothing.

The root is on ``sys.path`` for ``python -c`` and ``python -m pytest`` run there (the README's
test command). ``kernels`` is also HF's package, which transformers imports: before, the folder
won (``from transformers import LlamaForCausalLM`` raised ``cannot import name
'CUDAProperties' from 'kernels'``). Each check runs in a fresh interpreter started in the root.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "passes")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _run(code: str, *, cwd: Path = ROOT, pythonpath: str | None = None):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


@pytest.mark.skipif(not _installed("transformers"), reason="transformers is not installed")
def test_transformers_imports_from_the_root():
    """The control: failed on the old layout whenever HF's ``kernels`` is installed (a
    dependency of transformers ≥ 5.25)."""
    lines = _run(
        """
        import sys
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2,
        )
        LlamaForCausalLM(config)
        print(getattr(sys.modules.get("kernels"), "__file__", None))
        """
    )
    assert not lines[-1].startswith(str(ROOT)), lines


@pytest.mark.skipif(not _installed("kernels"), reason="HF's kernels is not installed")
@pytest.mark.parametrize("root_entry", ["cwd", "PYTHONPATH"])
def test_bare_kernels_from_the_root_is_hf_kernels(tmp_path, root_entry):
    """``''`` (``python -c``) or the root's absolute path (``python -m``, PYTHONPATH) first on
    ``sys.path``: ``import kernels`` is the installed HF package all the same."""
    cwd, pythonpath = (ROOT, None) if root_entry == "cwd" else (tmp_path, str(ROOT))
    lines = _run(
        """
        import importlib, importlib.metadata
        kernels = importlib.import_module("kernels")
        kernels.CUDAProperties  # what transformers imports
        print(kernels.__file__)
        print(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
        """,
        cwd=cwd,
        pythonpath=pythonpath,
    )
    assert Path(lines[-2]).resolve() == Path(lines[-1]).resolve()
    assert not lines[-2].startswith(str(ROOT))


@pytest.mark.parametrize("name", FOLDERS)
def test_an_installed_package_of_the_folders_name_wins(tmp_path, name):
    """A package ``name`` later on ``sys.path`` than the root (as site-packages is) is the one
    ``import name`` gives, submodules included; this file's folder defines nothing."""
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("MARK = 'installed'\n")
    (site / name / "sub.py").write_text("VALUE = 7\n")
    lines = _run(
        f"""
        import sys
        import {name}, {name}.sub
        from {name} import MARK
        print(MARK, {name}.sub.VALUE, {name}.__file__)
        print(sorted(m for m in sys.modules if m.startswith("dmuon_compile")))
        """,
        pythonpath=str(site),
    )
    assert lines[0] == f"installed 7 {site / name / '__init__.py'}"
    assert lines[1] == "[]"  # the folder's own code never ran (no dmuon_compile, no torch)


@pytest.mark.parametrize("name", FOLDERS)
def test_without_an_installed_package_the_folder_is_an_empty_namespace(name):
    """As if the folder had no ``__init__.py`` (what transformers' availability check treats as
    "not installed"), less its modules: nothing of dmuon_compile runs under the bare name."""
    lines = _run(
        f"""
        import importlib.util, sys
        sys.path[:] = [p for p in sys.path if "-packages" not in p]  # nothing installed
        import {name}
        print(getattr({name}, "__file__", None), getattr({name}, "__version__", None))
        print(sorted(m for m in sys.modules if m.startswith("dmuon_compile")))
        try:
            import {name}.ops
        except ModuleNotFoundError:
            print("no submodules")
        """
    )
    assert lines == ["None None", "[]", "no submodules"]


def test_the_package_imports_from_the_root_without_the_bare_names():
    lines = _run(
        """
        import sys
        import torch
        import dmuon_compile
        import dmuon_compile.integrations
        import dmuon_compile.kernels as k
        import dmuon_compile.passes as p

        assert k.__name__ == "dmuon_compile.kernels" and k.__file__.endswith("__init__.py")
        assert callable(k.triton_status) and callable(p.compile_options), (k, p)
        assert hasattr(torch.ops.dmuon, "syrk")
        print(sorted(m for m in ("kernels", "passes") if m in sys.modules))
        print(all(hasattr(dmuon_compile, n) for n in dmuon_compile.__all__))
        """
    )
    assert lines[-2:] == ["[]", "True"]


def _bare_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in FOLDERS)
    return found


def test_no_code_imports_the_folders_bare():
    offenders = {}
    for folder in ("dmuon_compile", *FOLDERS, "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found = _bare_imports(path.read_text(encoding="utf-8"))
            if found:
                offenders[str(path.relative_to(ROOT))] = sorted(found)
    assert not offenders, offenders
    assert _bare_imports("import kernels.ops\nfrom passes import x\n") == {"kernels.ops", "passes"}
    assert not _bare_imports("from dmuon_compile.kernels import ops\nfrom . import kernels\n")
