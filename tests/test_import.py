"""Package import, version and the torch-floor ImportError."""

import subprocess
import sys

import pytest

import dmuon_compile as dmuon
from dmuon_compile._compat import check_torch_version, parse_version


def test_version_string():
    assert dmuon.__version__.count(".") == 2


@pytest.mark.parametrize("old", ["2.4.0", "2.10.1+cu121", "1.13.1"])
def test_old_torch_raises_clear_import_error(old):
    with pytest.raises(ImportError, match=r"(?s)requires PyTorch >= 2\.11.*pip install"):
        check_torch_version(old)


@pytest.mark.parametrize("ok", ["2.11.0+cu130", "2.13.0+cpu", "2.14.1"])
def test_supported_torch_passes(ok):
    check_torch_version(ok)


def test_parse_version():
    assert parse_version("2.13.0+cpu") == (2, 13)
    assert parse_version("garbage") == (0, 0)


def test_subpackages_import_only_under_the_package_name():
    code = (
        "import importlib.util, dmuon_compile.passes, dmuon_compile.kernels;"
        "assert importlib.util.find_spec('passes') is None, 'bare passes importable'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def _run_from_checkout(code: str) -> subprocess.CompletedProcess:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=180
    )


def test_import_never_imports_the_integrations_frameworks():
    out = _run_from_checkout(
        "import sys, dmuon_compile, dmuon_compile.integrations;"
        "print(sorted(m for m in ('accelerate', 'transformers') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_accelerate_integration_without_accelerate_names_the_extra():
    out = _run_from_checkout(
        "import sys; sys.modules['accelerate'] = None\n"  # as if not installed
        "try:\n"
        "    import dmuon_compile.integrations.accelerate\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'pip install "dmuon_compile[accelerate]"' in out.stdout
