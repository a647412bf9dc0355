"""The repository itself: CI runs the README's test command, and every cited document exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("dmuon_compile", "passes", "kernels", "tests", "benchmarks", "docs", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".toml", ""}
# A document named in prose: docs/x.md, benchmarks/x.md or an upper-case NAME.md. A name after
# --out is a file a benchmark writes, not a citation.
CITATION = re.compile(r"(?<!--out )\b((?:docs/|benchmarks/)?[A-Za-z0-9_]+\.md)\b")
CITED_AS_DOCUMENT = re.compile(r"^(docs/|benchmarks/)|^[A-Z][A-Z0-9_]*\.md$")


def _texts():
    files = [p for p in ROOT.glob("*") if p.is_file() and p.suffix in {".md", ".toml"}]
    for folder in SOURCE_DIRS:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    for path in files:
        yield path, path.read_text(encoding="utf-8", errors="replace")


def missing_citations(text: str, here: Path) -> set[str]:
    """Documents ``text`` (a file in folder ``here``) cites that are not in the repository."""
    missing = set()
    for name in CITATION.findall(text):
        if not CITED_AS_DOCUMENT.search(name):
            continue
        candidates = [ROOT / name, here / name, ROOT / "docs" / name, ROOT / "benchmarks" / name]
        if not any(c.is_file() for c in candidates):
            missing.add(name)
    return missing


def test_every_cited_document_is_in_the_repository():
    found = {}
    for path, text in _texts():
        if path == Path(__file__).resolve():
            continue
        missing = missing_citations(text, path.parent)
        if missing:
            found[str(path.relative_to(ROOT))] = sorted(missing)
    assert not found, f"citations of documents that are not in the repository: {found}"


def test_missing_citation_check_has_teeth():
    text = "see DESIGN_NOTES.md and docs/nowhere.md; docs/architecture.md exists; --out OUT.md"
    assert missing_citations(text, ROOT) == {"DESIGN_NOTES.md", "docs/nowhere.md"}


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    at = readme.index("# the tests and the lint (what CI runs, .ci/run)")
    command = readme[at + 1]
    assert "ruff check ." in command and "ruff format --check ." in command and "pytest" in command
    assert command in ci


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    return readme[readme.index("# the tests and the lint (what CI runs, .ci/run)") + 1]


def test_the_test_command_installs_the_integrations_extras():
    """CI runs ``tests/integrations/`` rather than skipping it: the test command installs
    accelerate, transformers (≥ 5.25, which brings HF's ``kernels``), torchtitan and Triton, in
    one ``pip install`` (pyproject.toml's test extra says why one)."""
    command = _readme_test_command()
    assert command.count("pip install") == 1
    (extras,) = re.findall(r'pip install [^&]*-e "\.\[([a-z_,]+)\]"', command)
    extras = extras.split(",")
    assert {"test", "accelerate", "torchtitan"} <= set(extras)
    optional = _pyproject()["project"]["optional-dependencies"]
    requirements = [r for extra in extras for r in optional[extra]]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}
    assert {"accelerate", "transformers", "torchtitan", "triton"} <= names
    (transformers,) = [r for r in optional["test"] if r.startswith("transformers")]
    assert int(re.fullmatch(r"transformers>=5\.(\d+)", transformers).group(1)) >= 25


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_expression_with_its_file():
    """PEP 639: the license as an SPDX string plus license-files (setuptools deprecates the
    TOML table form and refuses a License classifier next to an expression)."""
    meta = _pyproject()
    project = meta["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"] and (ROOT / "LICENSE").is_file()
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+)", setuptools).group(1)) >= 77  # PEP 639 support


def test_numpy_is_listed_only_for_torch_and_the_reason_is_documented():
    """numpy is a dependency only so that ``import torch`` does not warn "Failed to initialize
    NumPy"; no module of the package imports it."""
    assert any(d.startswith("numpy") for d in _pyproject()["project"]["dependencies"])
    importing = [
        str(p.relative_to(ROOT))
        for folder in ("dmuon_compile", "passes", "kernels")
        for p in (ROOT / folder).rglob("*.py")
        if re.search(r"^\s*(import numpy|from numpy)", p.read_text(encoding="utf-8"), re.M)
    ]
    assert importing == []
    assert "Failed to initialize NumPy" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_quack_extra_is_declared():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("quack-kernels") for d in extras["quack"])


# ---------------------------------------------------------------------------- the import graph


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the text of module ``module``) imports, absolute names, anywhere
    in the file (late imports inside functions included)."""
    import ast

    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y / from .. import y
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _imports_of_distributed() -> dict[str, set[str]]:
    """The imports of every module of ``distributed/``, its subpackages included."""
    folder = ROOT / "dmuon_compile" / "distributed"
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder)
        parts = rel.parent.parts + (() if path.stem == "__init__" else (path.stem,))
        module = ".".join(("dmuon_compile", "distributed", *parts))
        if path.stem == "__init__":  # a package: relative imports resolve inside it
            module += ".__init__"
        out[rel.as_posix()] = imported_modules(path.read_text(encoding="utf-8"), module)
    return out


def test_the_runtime_does_not_import_the_optimizer():
    """One direction: the optimizer calls the runtime, never the reverse (routing rules, step
    phases and the runtime accessor live in modules below both)."""
    offenders = {
        name: sorted(m for m in mods if m == "dmuon_compile.optimizer")
        for name, mods in _imports_of_distributed().items()
    }
    assert not {n: m for n, m in offenders.items() if m}, offenders


def test_import_graph_check_has_teeth():
    late = "def f():\n    from dmuon_compile import optimizer as O\n"
    relative = "from ..optimizer import Muon\n"
    assert "dmuon_compile.optimizer" in imported_modules(late, "dmuon_compile.distributed._tp")
    assert "dmuon_compile.optimizer" in imported_modules(relative, "dmuon_compile.distributed.x")
    assert "dmuon_compile.optimizer" not in imported_modules(
        "from dmuon_compile.routing import route_model\n", "dmuon_compile.distributed.x"
    )


ENV_READ = re.compile(
    r"""(?:environ\.get|getenv)\(\s*["']DMUON_|environ\[\s*["']DMUON_|\benv_flag\("""
)


def test_dmuon_variables_are_read_in_one_module():
    """``dmuon_compile/env.py`` reads (and documents) every ``DMUON_*`` variable of the
    package."""
    readers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "dmuon_compile").rglob("*.py"))
        # log.py: the generic switch reader (progress lines; the kernel package's switches)
        if path.name not in ("env.py", "log.py")
        and ENV_READ.search(path.read_text(encoding="utf-8"))
    ]
    assert not readers, readers
    assert ENV_READ.search('os.environ.get("DMUON_NS_KERNEL", "")')  # the check has teeth
    assert ENV_READ.search("record = env_flag(PROFILE_ENV, False)")


# Private torch APIs are read in the compat modules only (docs/torch_internals.md lists them).
COMPAT_MODULES = {
    "dmuon_compile/_compat.py",
    "dmuon_compile/distributed/_dtensor_compat.py",
    "dmuon_compile/distributed/_fsdp_compat.py",
    "dmuon_compile/distributed/_autograd_compat.py",
    "dmuon_compile/distributed/_c10d_compat.py",
}
PRIVATE_TORCH = re.compile(
    r"\btorch\._(?!foreach_|_)\w|\b_C\.|distributed_c10d\._|\._get_fsdp_state\b|"
    r"\._(?:local_tensor|spec|mp_policy|fsdp_param_groups?|get_root_mesh|concatenate|"
    r"execution_engine|get_backend|device_types)\b|\b_init_backend\b|\b_current_graph_task_id\b|"
    r"\b_getframe\b|\butils\._pytree\b|\b_NormPartial\b|\b_dtensor_spec\b|\b_calculate_correct_fan\b"
)


def code_without_strings(source: str) -> str:
    """``source``'s code tokens (no strings, comments or docstrings), dotted names kept whole."""
    import io
    import tokenize

    skip = {tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT}
    skip |= {tokenize.DEDENT, tokenize.ENDMARKER}
    skip |= {
        getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE") if hasattr(tokenize, n)
    }
    out, prev = [], ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        out.append(tok.string if "." in (tok.string, prev) else " " + tok.string)
        prev = tok.string
    return "".join(out)


def private_torch_uses(source: str) -> list[str]:
    return PRIVATE_TORCH.findall(code_without_strings(source))


def test_private_torch_apis_are_read_in_the_compat_modules_only():
    offenders = {}
    for path in sorted((ROOT / "dmuon_compile").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in COMPAT_MODULES or {"kernels", "passes"} & set(path.parts[len(ROOT.parts) :]):
            continue
        found = private_torch_uses(path.read_text(encoding="utf-8"))
        if found:
            offenders[rel] = sorted(set(found))
    assert not offenders, (
        "private torch APIs outside the compat modules (read them through "
        f"dmuon_compile/_compat.py or distributed/_*_compat.py): {offenders}"
    )


def test_private_torch_check_has_teeth():
    text = (
        "x = t._local_tensor\nif torch._C._current_graph_task_id() != -1: pass\n"
        "g = dist.distributed_c10d._get_default_group()\nf = sys._getframe(1)\n"
        "s = module._get_fsdp_state()\nfrom torch.distributed.tensor._dtensor_spec import A\n"
    )
    assert all(private_torch_uses(line) for line in text.splitlines())
    clean = (
        '"""torch._inductor.config in a docstring"""\n# t._local_tensor in a comment\n'
        "torch._foreach_add_(a, b)\nx = self._spec_cache\nv = torch.__version__\n"
    )
    assert private_torch_uses(clean) == []
